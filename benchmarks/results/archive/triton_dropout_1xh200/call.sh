#!/usr/bin/env bash
# device call: GPU tests of the dropout-mask kernel, then the last-mile ablation (baseline, +triton_dropout, ...)
set -uo pipefail
OUT=${1:?}
export TORCH_EXTENSIONS_DIR=/tmp/zero3bench_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/zero3bench_inductor
T0=$SECONDS
left() { echo $(( ${DEADLINE:-575} - (SECONDS - T0) )); }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > "$OUT/gpus.txt" 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > /tmp/op_build.log 2>&1
echo "op build: $(tail -1 /tmp/op_build.log) at $((SECONDS - T0)) s"
if [ -n "${TESTS:-}" ]; then
  timeout -k 5 "${TEST_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS} > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$? at $((SECONDS - T0)) s: $(tail -1 "$OUT/gpu_tests.log")"
fi
A=/tmp/ablation_dropout
[ -n "${FRESH:-}" ] && rm -rf "$A"
if [ -n "${CONFIGS:-}" ]; then
  timeout -k 25 "$(left)" python3 benchmarks/ablation.py --set last_mile --configs="$CONFIGS" --profile_step 9 --keep \
    --timeout 400 --time_limit "$(( $(left) - 10 ))" --out "$A" > "$OUT/ablation.log" 2>&1
  echo "ablation rc=$? at $((SECONDS - T0)) s"
  tail -25 "$OUT/ablation.log"
  tar czf "$OUT/ablation_dropout.tar.gz" -C /tmp ablation_dropout
fi
echo "done at $((SECONDS - T0)) s"
