# Device call 1: one sub-group's step alone (fast vs fused, alternated), the ZeRO-3 optimizer step of the 1.5b preset
# with --zero3_step fast and fused, then the last-mile ablation's +fused_zero3_step (cold), then more step rounds.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS; W=/tmp/c1; rm -rf $W; mkdir -p $W $TORCHINDUCTOR_CACHE_DIR
[ -d devrun/bc ] && cp -rn devrun/bc/. $TORCHINDUCTOR_CACHE_DIR/
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus.txt 2>&1
python3 -c "import torch, triton, deepspeed, lightning; print(torch.__version__, triton.__version__, deepspeed.__version__, lightning.__version__)" >> $W/gpus.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build.log 2>&1
echo "op build: $(tail -1 $W/op_build.log) at $((SECONDS - T0)) s"
timeout -k 5 90 python3 benchmarks/adamw_step.py --repeats 7 --out $W/adamw_step.json > $W/adamw_step.log 2>&1
echo "adamw_step rc=$? at $((SECONDS - T0)) s"; tail -4 $W/adamw_step.log
opt() {  # round mode
  L=$(( 585 - (SECONDS - T0) )); [ $L -lt 60 ] && { echo "no time for optimizer step $2 $1"; return; }
  timeout -k 10 $L python3 benchmarks/optimizer_step.py --preset 1.5b --stage 3 --precision bf16 --micro_batch 4 \
    --steps 11 --warmup_steps 3 --zero3_step $2 --out $W/optimizer_step_${2}_$1.json > $W/optimizer_step_${2}_$1.log 2>&1
  echo "$2 $1 rc=$? at $((SECONDS - T0)) s: $(grep 'optimizer step:' $W/optimizer_step_${2}_$1.log)"
}
opt 0 fast; opt 0 fused
L=$(( 585 - (SECONDS - T0) ))
timeout -k 25 $L python3 benchmarks/ablation.py --set last_mile --configs=+fused_zero3_step --keep \
  --out $W/ablation_cold > $W/ablation_cold.log 2>&1
echo "ablation +fused_zero3_step exit $? at $((SECONDS - T0)) s"; tail -8 $W/ablation_cold.log
opt 1 fused; opt 1 fast
(cd $W && tar czf $OUT/c1.tgz .)
