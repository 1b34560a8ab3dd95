# Call 1: the bias + GELU kernel's GPU tests (its autograd functions as refactored), then the last-mile ablation's
# second pair for +triton_gelu_grad (lever first this time), then +triton_loss if it fits (raw path, GPU default).
CALL=1; source devrun/pre.sh
timeout 150 python3 -m pytest -q -m gpu tests/test_bias_gelu_grad.py tests/test_fused_ops.py -p no:cacheprovider > $W/gpu_tests_kernel.log 2>&1
echo "kernel gpu tests rc=$? at $((SECONDS - T0)) s: $(tail -1 $W/gpu_tests_kernel.log)"
wait $BUILD; echo "op build: $(tail -1 $W/op_build_$CALL.log) at $((SECONDS - T0)) s"
timeout -k 25 $(( 585 - (SECONDS - T0) )) python3 benchmarks/ablation.py --set last_mile \
  --configs=+triton_gelu_grad,baseline,+triton_loss --keep --time_limit $(( 570 - (SECONDS - T0) )) --timeout 400 \
  --out $W/ablation > $W/ablation_$CALL.log 2>&1
echo "ablation exit $? at $((SECONDS - T0)) s"; tail -8 $W/ablation_$CALL.log
(cd $W && tar czf $OUT/s15_$CALL.tgz --exclude='*.pt' .)
