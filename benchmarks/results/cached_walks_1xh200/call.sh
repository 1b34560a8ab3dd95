# Call D: the ablation's +cached_walks (DeepSpeed's walks of the model around each step under DeepCompile over
# lists taken once) and baseline, raw path, compare.py's GPU default; then the lever's GPU test.
# PART=2: baseline_again, then the GPU test if the first call had no time for it.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_cache TORCH_EXTENSIONS_DIR=/tmp/tx
T0=$SECONDS; DEADLINE=${DEADLINE:-585}
left() { echo $(( DEADLINE - (SECONDS - T0) - 5 )); }
W=/tmp/cwalks; mkdir -p $W /tmp/ind_cache
echo "warm: $(ls /tmp/ind_cache | wc -l) cache entries, ablation runs: $(ls $W/abl/runs 2>/dev/null | tr '\n' ' ')"
cp -rn devrun/bc/. /tmp/ind_cache/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus_$PART.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build_$PART.log 2>&1
echo "op build $(tail -1 $W/op_build_$PART.log) $((SECONDS-T0)) s"
if [ "$PART" = 1 ]; then CONFIGS=+cached_walks,baseline; else CONFIGS=baseline_again; fi
timeout -k 20 "$(left)" python3 benchmarks/ablation.py --set last_mile --configs=$CONFIGS --keep --timeout 400 \
  --out $W/abl > $W/ablation_call$PART.log 2>&1
echo "ablation rc=$? at $((SECONDS-T0)) s"; tail -14 $W/ablation_call$PART.log
if ! grep -q "1 passed" $W/gpu_tests_*.log 2>/dev/null && [ "$(left)" -gt 150 ]; then
  timeout -k 10 "$(left)" python3 -m pytest -q -m gpu tests/test_deepcompile.py -k "cached_walks" \
    -p no:cacheprovider -rA > $W/gpu_tests_$PART.log 2>&1; echo "gpu tests rc=$? at $((SECONDS-T0)) s"
  tail -3 $W/gpu_tests_$PART.log
fi
cd /tmp && tar czf $OUT/cwalks.tgz cwalks; ls -la $OUT
