# Device call 2 (warm machine, inductor cache of call 1): the last-mile ablation's baseline and +fused_zero3_step in
# one ablation.py (order CONFIGS), the whole-step ratio inside one call.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS; W=/tmp/c2_$1; rm -rf $W; mkdir -p $W $TORCHINDUCTOR_CACHE_DIR
[ -d devrun/bc ] && cp -rn devrun/bc/. $TORCHINDUCTOR_CACHE_DIR/
ls /tmp/zero3bench_inductor | head -3 > $W/cache_state.txt; du -sh /tmp/zero3bench_inductor /tmp/zero3bench_extensions >> $W/cache_state.txt 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build.log 2>&1
echo "op build: $(tail -1 $W/op_build.log) at $((SECONDS - T0)) s"
timeout -k 25 $(( 380 - (SECONDS - T0) )) python3 benchmarks/ablation.py --set last_mile --configs=$2 \
  --keep --time_limit $(( 360 - (SECONDS - T0) )) --out $W/ablation > $W/ablation.log 2>&1
echo "ablation exit $? at $((SECONDS - T0)) s"; tail -14 $W/ablation.log
(cd $W && tar czf $OUT/c2_$1.tgz .)
