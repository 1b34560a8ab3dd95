source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions
T0=$SECONDS; DEADLINE=${DEADLINE:-580}
left() { echo $(( DEADLINE - (SECONDS - T0) - 5 )); }
W=/tmp/c1; mkdir -p $W
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build.log 2>&1 &
OPB=$!
timeout 150 python3 -m pytest -q -m gpu tests/test_zero3_step.py -p no:cacheprovider -rA > $W/gpu_tests_zero3_step.log 2>&1
echo "gpu tests rc=$? $((SECONDS-T0)) s"; grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" $W/gpu_tests_zero3_step.log | tail -5
wait $OPB; echo "op build $(tail -1 $W/op_build.log) $((SECONDS-T0)) s"
SYNC_DEBUG_STEP=12 SYNC_DEBUG_OUT=$W/syncdebug.json timeout -k 20 "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node=1 devrun/syncdebug.py plain_deepspeed/train.py \
 --triton_gelu_grad true --preset 1.5b --stage 3 --precision bf16 --micro_batch 16 --steps 14 --warmup_steps 10 \
 --compile deepcompile --deepcompile_schedule once --deepcompile_persist threshold --deepcompile_eager_persist drop \
 --deepcompile_cached_walks true --coordinate_descent_tuning true --zero3_step fused --zero_profile tuned \
 --python_gc freeze --data synthetic --profile_step 9 --profile_stack true --profile_sync false --log_every 10 \
 --out $W/stack_nosync_deepspeed.json > $W/stack_nosync_deepspeed.log 2>&1
echo "run rc=$? at $((SECONDS-T0)) s"; tail -4 $W/stack_nosync_deepspeed.log
cp $W/*.json $W/*.log $W/gpus.txt $OUT/ 2>/dev/null; ls $OUT
