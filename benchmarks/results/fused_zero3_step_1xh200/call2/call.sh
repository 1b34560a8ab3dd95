# Device call: the last-mile ablation's baseline (compare.py's GPU default, raw path) then +fused_zero3_step, one
# ablation.py each (--keep), then, in what is left, the isolated ZeRO-3 step with --zero3_step fast and fused.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS; W=/tmp/fin; mkdir -p $W $TORCHINDUCTOR_CACHE_DIR
[ -d devrun/bc ] && cp -rn devrun/bc/. $TORCHINDUCTOR_CACHE_DIR/
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build.log 2>&1
echo "op build: $(tail -1 $W/op_build.log) at $((SECONDS - T0)) s"
for c in baseline +fused_zero3_step; do
  L=$(( 585 - (SECONDS - T0) )); [ $L -lt 120 ] && { echo "no time for $c"; continue; }
  timeout -k 25 $L python3 benchmarks/ablation.py --set last_mile --configs=$c --keep --out $W/ablation_fused \
    >> $W/ablation_fused.log 2>&1
  echo "ablation $c exit $? at $((SECONDS - T0)) s"
done
tail -12 $W/ablation_fused.log
for mode in fast fused; do
  L=$(( 590 - (SECONDS - T0) )); [ $L -lt 45 ] && { echo "no time for optimizer step $mode"; continue; }
  timeout -k 10 $L python3 benchmarks/optimizer_step.py --preset 1.5b --stage 3 --precision bf16 --micro_batch 4 \
    --steps 11 --warmup_steps 3 --zero3_step $mode --out $W/optimizer_step_${mode}_0.json > $W/optimizer_step_${mode}_0.log 2>&1
  echo "$mode rc=$? at $((SECONDS - T0)) s: $(grep 'optimizer step:' $W/optimizer_step_${mode}_0.log)"
done
(cd $W && tar czf $OUT/fin.tgz .)
