# Call B: the GPU tests of the changed files (while DeepSpeed's op builds), then one raw DeepCompile run of compare's
# GPU default whose profiled step records Python frames (--profile_stack).
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_cache TORCH_EXTENSIONS_DIR=/tmp/tx
T0=$SECONDS; DEADLINE=${DEADLINE:-420}
left() { echo $(( DEADLINE - (SECONDS - T0) - 5 )); }
W=/tmp/pstack; mkdir -p $W /tmp/ind_cache
cp -rn devrun/bc/. /tmp/ind_cache/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build.log 2>&1 &
OPB=$!
timeout 120 python3 -m pytest -q -m gpu tests/test_timing.py tests/test_fused_ops.py -p no:cacheprovider \
  -p no:logging -rA > $W/gpu_tests.log 2>&1; echo "gpu tests rc=$? $((SECONDS-T0)) s"; grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" $W/gpu_tests.log | tail -14
wait $OPB; echo "op build $(tail -1 $W/op_build.log) $((SECONDS-T0)) s"
timeout -k 20 "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node=1 plain_deepspeed/train.py \
  --preset 1.5b --stage 3 --precision bf16 --micro_batch 16 --steps 12 --warmup_steps 10 --compile deepcompile \
  --deepcompile_schedule once --deepcompile_persist threshold --coordinate_descent_tuning true --zero3_step fast \
  --zero_profile tuned --python_gc freeze --data synthetic --profile_step 9 --profile_stack true \
  --out $W/stack_deepspeed.json > $W/stack_deepspeed.log 2>&1
echo "run rc=$? at $((SECONDS-T0)) s"; tail -5 $W/stack_deepspeed.log
cp $W/stack_deepspeed.json $W/stack_deepspeed.log $W/gpu_tests.log $W/gpus.txt $W/op_build.log $OUT/ 2>/dev/null; ls -la $OUT
