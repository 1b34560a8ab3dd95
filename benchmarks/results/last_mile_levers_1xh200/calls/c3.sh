# Calls 3-4: the last-mile ablation continued (+triton_loss, then baseline_again), no kernel tests.
CALL=${CALL:-3}; source devrun/pre.sh
wait $BUILD; echo "op build: $(tail -1 $W/op_build_$CALL.log) at $((SECONDS - T0)) s"
timeout -k 25 $(( 585 - (SECONDS - T0) )) python3 benchmarks/ablation.py --set last_mile \
  --configs=+triton_gelu_grad,baseline,+triton_loss,baseline_again --keep --time_limit $(( 570 - (SECONDS - T0) )) \
  --timeout 400 --out $W/ablation > $W/ablation_$CALL.log 2>&1
echo "ablation exit $? at $((SECONDS - T0)) s"; tail -8 $W/ablation_$CALL.log
(cd $W && tar czf $OUT/s15_$CALL.tgz --exclude='*.pt' .)
