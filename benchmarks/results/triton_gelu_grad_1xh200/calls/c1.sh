# Call 1: the kernel's GPU tests, the MLP tail microbenchmark (three backwards), then the last-mile ablation's
# baseline and +triton_gelu_grad (raw path, compare.py's GPU default) in one ablation.py.
CALL=1; source devrun/pre.sh
timeout 150 python3 -m pytest -q -m gpu tests/test_bias_gelu_grad.py tests/test_fused_ops.py -p no:cacheprovider > $W/gpu_tests_kernel.log 2>&1
echo "kernel gpu tests rc=$? at $((SECONDS - T0)) s: $(tail -1 $W/gpu_tests_kernel.log)"
timeout 150 python3 benchmarks/mlp_tail.py --out $W/mlp_tail.json > $W/mlp_tail.log 2>&1
echo "mlp_tail rc=$? at $((SECONDS - T0)) s"; tail -2 $W/mlp_tail.log | cut -c1-600
wait $BUILD; echo "op build: $(tail -1 $W/op_build_$CALL.log) at $((SECONDS - T0)) s"
timeout -k 25 $(( 585 - (SECONDS - T0) )) python3 benchmarks/ablation.py --set last_mile \
  --configs=baseline,+triton_gelu_grad --keep --time_limit $(( 570 - (SECONDS - T0) )) --timeout 400 \
  --out $W/ablation > $W/ablation_$CALL.log 2>&1
echo "ablation exit $? at $((SECONDS - T0)) s"; tail -8 $W/ablation_$CALL.log
(cd $W && tar czf $OUT/s14_$CALL.tgz --exclude='*.pt' .)
