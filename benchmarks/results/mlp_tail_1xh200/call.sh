# Call A: the MLP-tail microbenchmark (while DeepSpeed's op builds), then the ablation's +matmul_bias_grad and
# baseline (raw path, DeepCompile GPU default). PART=2: baseline_again and the GPU tests.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_cache TORCH_EXTENSIONS_DIR=/tmp/tx
T0=$SECONDS; DEADLINE=${DEADLINE:-585}
left() { echo $(( DEADLINE - (SECONDS - T0) - 5 )); }
W=/tmp/mbg; mkdir -p $W /tmp/ind_cache
echo "warm: $(ls /tmp/ind_cache | wc -l) cache entries, ablation runs: $(ls $W/abl/runs 2>/dev/null | tr '\n' ' ')"
cp -rn devrun/bc/. /tmp/ind_cache/ 2>/dev/null
if [ ! -d $W/abl ] && [ -d devrun/abl ]; then cp -r devrun/abl $W/abl; echo "restored ablation folder"; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus_$PART.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build_$PART.log 2>&1 &
OPB=$!
if [ "$PART" = 1 ]; then
  python3 benchmarks/mlp_tail.py --out $W/mlp_tail.json > $W/mlp_tail.log 2>&1; echo "mlp_tail rc=$? $((SECONDS-T0)) s"
  tail -4 $W/mlp_tail.log; CONFIGS=+matmul_bias_grad,baseline
else
  CONFIGS=baseline_again
fi
wait $OPB; echo "op build $(tail -1 $W/op_build_$PART.log) $((SECONDS-T0)) s"
timeout -k 20 "$(left)" python3 benchmarks/ablation.py --set last_mile --configs $CONFIGS --keep --timeout 400 \
  --out $W/abl > $W/ablation_call$PART.log 2>&1
echo "ablation rc=$? at $((SECONDS-T0)) s"; tail -12 $W/ablation_call$PART.log
if [ "$PART" != 1 ] && [ "$(left)" -gt 60 ]; then
  timeout -k 10 "$(left)" python3 -m pytest -q -m gpu tests/test_fused_ops.py -k "matmul_bias or bf16_fused" \
    -p no:cacheprovider > $W/gpu_tests_$PART.log 2>&1; echo "gpu tests rc=$?"; tail -3 $W/gpu_tests_$PART.log
fi
cd /tmp/ind_cache && find . -name '*.best_config' -print0 | tar czf $OUT/best_configs.tgz --null -T -
cd /tmp && tar czf $OUT/mbg.tgz mbg; ls -la $OUT
