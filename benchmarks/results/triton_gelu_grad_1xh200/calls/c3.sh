# Call 3: DeepCompile GPU tests of the new kernel and of resume/export with the fused optimizer step.
CALL=3; source devrun/pre.sh
wait $BUILD; echo "op build: $(tail -1 $W/op_build_$CALL.log) at $((SECONDS - T0)) s"
timeout -k 20 $(( 580 - (SECONDS - T0) )) python3 -m pytest -q -m gpu -p no:cacheprovider \
  "tests/test_deepcompile.py::test_the_triton_gelu_grad_trains_like_inductors_backward_under_deepcompile" \
  "tests/test_deepcompile.py::test_deepcompile_validates_saves_exports_and_resumes_at_the_end" > $W/gpu_tests_dc.log 2>&1
echo "dc gpu tests rc=$? at $((SECONDS - T0)) s: $(tail -1 $W/gpu_tests_dc.log)"
(cd $W && tar czf $OUT/s14_$CALL.tgz --exclude='*.pt' --exclude='ablation' .)
