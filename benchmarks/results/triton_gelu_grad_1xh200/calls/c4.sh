# Call 4: the kernel's GPU tests with every launch writing every row of the partial sums, and the MLP tail again.
CALL=4; source devrun/pre.sh
kill $BUILD 2>/dev/null
timeout 200 python3 -m pytest -q -m gpu tests/test_bias_gelu_grad.py tests/test_fused_ops.py -p no:cacheprovider > $W/gpu_tests_kernel_4.log 2>&1; echo "kernel gpu tests rc=$?: $(tail -1 $W/gpu_tests_kernel_4.log)"
timeout 200 python3 benchmarks/mlp_tail.py --out $W/mlp_tail_4.json > $W/mlp_tail_4.log 2>&1; echo "mlp_tail rc=$?"; tail -2 $W/mlp_tail_4.log | cut -c1-600
(cd $W && tar czf $OUT/s14_$CALL.tgz gpu_tests_kernel_4.log mlp_tail_4.json mlp_tail_4.log gpus_$CALL.txt)
