# Device call: DeepCompile's Lightning resume/export GPU test with every default, then the other GPU tests.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $OUT/gpus.txt 2>&1
python3 -c "import torch, triton, deepspeed, lightning; print(torch.__version__, triton.__version__, deepspeed.__version__, lightning.__version__)" >> $OUT/gpus.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $OUT/op_build.log 2>&1
echo "op build: $(tail -1 $OUT/op_build.log) at $((SECONDS - T0)) s"
timeout -k 10 330 python3 -m pytest -m gpu "tests/test_deepcompile.py::test_deepcompile_validates_saves_exports_and_resumes_at_the_end[lightning]" \
  -q -s --tb=short -p no:cacheprovider -rA > $OUT/gpu_tests_resume_lightning.log 2>&1
echo "lightning resume test rc=$? at $((SECONDS - T0)) s"; tail -3 $OUT/gpu_tests_resume_lightning.log
L=$(( 585 - (SECONDS - T0) ))
timeout -k 10 $L python3 -m pytest -m gpu tests/test_fused_ops.py tests/test_fused_loss.py tests/test_attention_backends.py \
  tests/test_inductor_tuning.py tests/test_timing.py -q --tb=short -p no:cacheprovider -rA > $OUT/gpu_tests_other.log 2>&1
echo "other gpu tests rc=$? at $((SECONDS - T0)) s"; tail -3 $OUT/gpu_tests_other.log
