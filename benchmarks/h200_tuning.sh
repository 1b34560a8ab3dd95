#!/usr/bin/env bash
# The tuning issue's remaining GPU runs (issue 6), for one device call on nvidia-h200 (or -x2 with GPUS=2):
#   1. python compare.py --autotune on the 1.5b preset within a time budget (raw path; writes the winner JSON)
#   2. compare.py, both paths: the naive (original) config, the tuned profile, and the autotune winner
# Usage on the device machine, from the repo root:  GPUS=1 bash benchmarks/h200_tuning.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: h200_tuning.sh OUTDIR}
G=${GPUS:-1}
W="$OUT/work"
mkdir -p "$W"
BASE=(--gpus "$G" --preset 1.5b --stage 3 --precision bf16 --steps 14 --warmup_steps 5)
timeout "${AUTOTUNE_S:-300}" python3 compare.py "${BASE[@]}" --autotune --mb_grid 8,12,16,24 \
  --budget_s "$(( ${AUTOTUNE_S:-300} - 40 ))" --out "$W/autotune"
WIN=$(python3 -c "import json; print(json.load(open('$W/autotune/autotune.json'))['winner_flags'])" 2>/dev/null)
timeout 120 python3 compare.py "${BASE[@]}" --micro_batch 8 --repeats 1 --zero_profile original \
  --fused_bias_dropout_add false --fused_bias_gelu false --out "$W/naive"
timeout 120 python3 compare.py "${BASE[@]}" --micro_batch 8 --repeats 1 --out "$W/tuned"
[ -n "$WIN" ] && timeout 200 python3 compare.py "${BASE[@]}" --repeats 2 $WIN --out "$W/winner"
tar czf "$OUT/h200_tuning.tar.gz" -C "$W" .
