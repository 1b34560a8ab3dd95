# The headline compare of compare.py's GPU default (both paths and the ceiling; REPEATS rounds), continued from the
# last call's folder on this machine (KEEP=warm) when there is one. TEST=1 first runs the bias + GELU kernel's
# DeepCompile GPU test on the Lightning path.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS
mkdir -p $TORCHINDUCTOR_CACHE_DIR /tmp/s16; cp -rn devrun/bc/. $TORCHINDUCTOR_CACHE_DIR/
echo "warm: $(ls $TORCHINDUCTOR_CACHE_DIR | wc -l) inductor cache entries; extensions: $(ls $TORCH_EXTENSIONS_DIR 2>/dev/null | tr '\n' ' ')"
if [ "${TEST:-0}" = 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/test_deepcompile.py -k "triton_gelu_grad and lightning" \
    -p no:cacheprovider > /tmp/s16/gpu_test_lightning_kernel.log 2>&1
  echo "DC kernel test (lightning) rc=$? at $((SECONDS - T0)) s: $(tail -1 /tmp/s16/gpu_test_lightning_kernel.log)"
  cp /tmp/s16/gpu_test_lightning_kernel.log $OUT/
fi
K=; if [ -d /tmp/keep_headline_1xh200 ]; then K=warm; fi
echo "KEEP=$K"
STAGE=headline REPEATS=${REPEATS:-2} KEEP=$K DEADLINE_S=$(( 582 - (SECONDS - T0) )) bash benchmarks/h200_deepcompile.sh $OUT
echo "end at $((SECONDS - T0)) s"
