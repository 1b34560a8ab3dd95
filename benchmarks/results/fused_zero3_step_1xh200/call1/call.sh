# Device call: GPU tests of the AdamW kernel, the fused ZeRO-3 step and the chunked loss; then the ZeRO-3 optimizer
# step of the 1.5b preset, --zero3_step fast and fused alternated (benchmarks/optimizer_step.py).
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS; W=/tmp/fz; mkdir -p $W
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus.txt 2>&1
timeout -k 10 260 python3 -m pytest -m gpu tests/test_adamw_kernel.py tests/test_fused_loss.py tests/test_zero3_step.py \
  -q -s --tb=short -p no:cacheprovider -rA > $W/gpu_tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.log | tail -8
for r in 0 1; do
  for mode in fast fused; do
    L=$(( 580 - (SECONDS - T0) )); [ $L -lt 40 ] && { echo "no time for $mode $r"; continue; }
    timeout -k 10 $L python3 benchmarks/optimizer_step.py --preset 1.5b --stage 3 --precision bf16 --micro_batch 4 \
      --steps 11 --warmup_steps 3 --zero3_step $mode --out $W/optimizer_step_${mode}_$r.json > $W/optimizer_step_${mode}_$r.log 2>&1
    echo "$mode $r rc=$? at $((SECONDS - T0)) s: $(grep 'optimizer step:' $W/optimizer_step_${mode}_$r.log)"
  done
done
(cd $W && tar czf $OUT/fz.tgz .)
