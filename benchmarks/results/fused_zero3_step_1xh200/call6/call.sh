# Device call 6: the fused step's GPU test on the Lightning path (the raw path's ran in call 1).
source .whl/activate.sh || exit 1; export PYTHONPATH=$PWD:$PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt
python3 -c "import torch, triton, deepspeed, lightning; print(torch.__version__, triton.__version__, deepspeed.__version__, lightning.__version__)" >> $OUT/gpus.txt 2>&1
timeout -k 5 220 python3 -m pytest -m gpu "tests/test_zero3_step.py::test_gpu_fused_step_trains_like_the_fast_step[lightning]" \
  -q -s --tb=short -p no:cacheprovider -rA > $OUT/gpu_test_lightning.log 2>&1
