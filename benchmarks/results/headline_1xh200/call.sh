# Device call: STAGE=headline of benchmarks/h200_deepcompile.sh, continued from devrun/headline_1xh200 (the last
# call's folder) when it exists; then, with TESTS=1 and time left, the DeepCompile resume/export GPU tests.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS
mkdir -p $TORCHINDUCTOR_CACHE_DIR; [ -d devrun/bc ] && cp -rn devrun/bc/. $TORCHINDUCTOR_CACHE_DIR/
echo "warm: $(ls $TORCHINDUCTOR_CACHE_DIR 2>/dev/null | wc -l) inductor cache entries"
K=; [ -d devrun/headline_1xh200 ] && K=$PWD/devrun/headline_1xh200 && echo "continuing: $(ls $K/runs | tr '\n' ' ')"
STAGE=headline KEEP=$K DEADLINE_S=${DEADLINE_S:-565} bash benchmarks/h200_deepcompile.sh $OUT
echo "headline stage done at $((SECONDS - T0)) s"
if [ "${TESTS:-0}" = 1 ]; then
  L=$(( 590 - (SECONDS - T0) ))
  timeout -k 10 $L python3 -m pytest -q -m gpu tests/test_deepcompile.py -k "validates_saves_exports_and_resumes and raw" \
    -p no:cacheprovider -rA > $OUT/gpu_tests_resume.log 2>&1; echo "gpu tests rc=$? at $((SECONDS - T0)) s"
  tail -5 $OUT/gpu_tests_resume.log
fi
(cd $TORCHINDUCTOR_CACHE_DIR && find . -name "*.best_config" -print0 | tar czf $OUT/best_configs.tgz --null -T -)
