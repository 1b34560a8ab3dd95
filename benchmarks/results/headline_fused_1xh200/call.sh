# Device call: STAGE=headline of benchmarks/h200_deepcompile.sh with EXTRA="--zero3_step fused", continued from the
# last call's folder: /tmp/keep_headline on a machine kept warm, else devrun/headline_1xh200 (copied in the repo).
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS
mkdir -p $TORCHINDUCTOR_CACHE_DIR; [ -d devrun/bc ] && cp -rn devrun/bc/. $TORCHINDUCTOR_CACHE_DIR/
echo "warm: $(ls $TORCHINDUCTOR_CACHE_DIR 2>/dev/null | wc -l) inductor cache entries; extensions: $(ls /tmp/zero3bench_extensions 2>/dev/null | tr '\n' ' ')"
K=
if [ -d /tmp/keep_headline ]; then K=/tmp/keep_headline; elif [ -d devrun/headline_1xh200 ]; then K=$PWD/devrun/headline_1xh200; fi
[ -n "$K" ] && echo "continuing $K: $(ls $K/runs | tr '\n' ' ')"
STAGE=headline EXTRA="--zero3_step fused" KEEP=$K DEADLINE_S=${DEADLINE_S:-570} bash benchmarks/h200_deepcompile.sh $OUT
echo "headline stage done at $((SECONDS - T0)) s"
rm -rf /tmp/keep_headline.new; cp -r /tmp/h200_deepcompile/headline_1xh200 /tmp/keep_headline.new && rm -rf /tmp/keep_headline && mv /tmp/keep_headline.new /tmp/keep_headline
(cd $TORCHINDUCTOR_CACHE_DIR && find . -name "*.best_config" -print0 | tar czf $OUT/best_configs.tgz --null -T -)
echo "end at $((SECONDS - T0)) s"
