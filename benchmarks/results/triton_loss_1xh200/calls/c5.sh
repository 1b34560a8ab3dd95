# Call 5 (what was left of the device time): the cross-entropy kernel's GPU test, the LM head + loss benchmark,
# then the DeepCompile test with --triton_loss if time remains.
CALL=5; source devrun/pre.sh
timeout 70 python3 -m pytest -q -m gpu tests/test_cross_entropy.py -p no:cacheprovider > $W/gpu_tests_ce.log 2>&1; echo "ce gpu tests rc=$? at $((SECONDS - T0)) s: $(tail -1 $W/gpu_tests_ce.log)"
timeout 100 python3 benchmarks/lm_loss.py --out $W/lm_loss.json > $W/lm_loss.log 2>&1; echo "lm_loss rc=$? at $((SECONDS - T0)) s"; tail -2 $W/lm_loss.log | cut -c1-500
(cd $W && tar czf $OUT/s14_$CALL.tgz gpu_tests_ce.log lm_loss.json lm_loss.log gpus_$CALL.txt)
wait $BUILD; echo "op build at $((SECONDS - T0)) s"
timeout -k 5 $(( 225 - (SECONDS - T0) )) python3 -m pytest -q -m gpu -p no:cacheprovider \
  "tests/test_deepcompile.py::test_the_triton_loss_trains_like_the_models_loss_under_deepcompile" > $W/gpu_tests_dc_loss.log 2>&1
echo "dc loss test rc=$? at $((SECONDS - T0)) s: $(tail -1 $W/gpu_tests_dc_loss.log)"
(cd $W && tar czf $OUT/s14_$CALL.tgz gpu_tests_ce.log lm_loss.json lm_loss.log gpus_$CALL.txt gpu_tests_dc_loss.log op_build_$CALL.log)
