#!/usr/bin/env bash
# The ZeRO-3 tuning GPU runs, one device call each, on nvidia-h200-x2:
#   GPUS=1  one-GPU figures, two streams at once, one GPU each:
#           GPU 1: compare.py --autotune, then compare.py with the naive (original) config, the tuned profile
#                  and the autotune winner (both paths each);
#           GPU 0: DeepSpeed's own autotuner (benchmarks/ds_autotuner.py), then, once GPU 1's autotune has
#                  written its winner, DeepSpeed's optimal config against that winner on the raw loop.
#   GPUS=2  compare.py --autotune on both GPUs, then the winner (WIN_REPEATS, default 2), naive, tuned.
#   VERSUS=autotune.json  DeepSpeed's autotuner on GPUs 0..GPUS-1 and its optimal config against that file's
#           winner (MB_LIST: its micro-batches; TUNED_TOO=1: then the tuned profile at micro-batch 8, both paths).
# Every step gets what is left of DEADLINE_S (default 560 s), so the call ends inside the device's 10 minutes
# with its results packed into OUTDIR/h200_tuning.tar.gz. Usage on the device machine, from the repo root:
#   GPUS=1 bash benchmarks/h200_tuning.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: h200_tuning.sh OUTDIR}
G=${GPUS:-1}
W=${WORK:-/tmp/h200_tuning}  # outside OUTDIR: only the archive comes back
rm -rf "$W"  # a warm machine keeps /tmp: nothing of an earlier call may pass for this one's
mkdir -p "$W"
T0=$SECONDS
DEADLINE=${DEADLINE_S:-560}
# limit N: N seconds, or what is left before the deadline less 10 s for packing; 0 when less than 80% of N is
# left (a run cut short measures nothing).
limit() { local l=$(( DEADLINE - (SECONDS - T0) - 10 )); (( l * 5 < $1 * 4 )) && echo 0 || echo $(( $1 < l ? $1 : l )); }
step() {  # step CAP CMD...: run CMD under the smaller of CAP and the time left, or skip it
  local t; t=$(limit "$1"); shift
  if (( t == 0 )); then echo "skipped (deadline): $*"; return 1; fi
  timeout -k 10 "$t" "$@"
}
BASE=(--preset 1.5b --stage 3 --precision bf16 --steps 14 --warmup_steps 5)
AUTOTUNE_S=${AUTOTUNE_S:-230}

ours() {  # compare.py --autotune, then naive / tuned / winner; $1: GPUs per run
  step "$AUTOTUNE_S" python3 compare.py --gpus "$1" "${BASE[@]}" --autotune --mb_grid "${GRID:-8,12,16,24}" \
    --budget_s "$(( AUTOTUNE_S - 30 ))" --out "$W/autotune" > "$W/autotune.log" 2>&1
  local win
  win=$(python3 -c "import json; print(json.load(open('$W/autotune/autotune.json'))['winner_flags'])" 2>/dev/null)
  # shellcheck disable=SC2086  # the winner's flags are words
  [ -n "$win" ] && [ "$1" != 1 ] && step 300 python3 compare.py --gpus "$1" "${BASE[@]}" \
    --repeats "${WIN_REPEATS:-2}" $win --out "$W/winner" > "$W/winner.log" 2>&1
  step 110 python3 compare.py --gpus "$1" "${BASE[@]}" --micro_batch 8 --repeats 1 --zero_profile original \
    --fused_bias_dropout_add false --fused_bias_gelu false --out "$W/naive" > "$W/naive.log" 2>&1
  step 110 python3 compare.py --gpus "$1" "${BASE[@]}" --micro_batch 8 --repeats 1 --out "$W/tuned" \
    > "$W/tuned.log" 2>&1
  # shellcheck disable=SC2086  # the winner's flags are words
  [ -n "$win" ] && [ "$1" = 1 ] && step 240 python3 compare.py --gpus 1 "${BASE[@]}" --repeats "${WIN_REPEATS:-1}" \
    $win --out "$W/winner" > "$W/winner.log" 2>&1
}

deepspeeds() {  # DeepSpeed's autotuner, then its optimal config against our winner ($1: its autotune.json; $2: GPUs)
  step $(( ${TUNER_S:-250} + 30 )) python3 benchmarks/ds_autotuner.py --gpus "$2" "${BASE[@]}" --mb_list "${MB_LIST:-8,12,16}" \
    --tuner_timeout "${TUNER_S:-250}" --out "$W/ds_autotuner" > "$W/ds_autotuner.log" 2>&1
  # compare.py --autotune rewrites its autotune.json after every candidate: wait for the finished one
  done_() { python3 -c "import json, sys; sys.exit(json.load(open(sys.argv[1])).get('complete') is False)" "$1" \
    2>/dev/null; }
  while ! done_ "$1" && (( $(limit 200) > 0 )); do sleep 5; done
  done_ "$1" && step 200 python3 benchmarks/ds_autotuner.py --gpus "$2" "${BASE[@]}" \
    --versus "$1" --reuse --repeats "${VERSUS_REPEATS:-2}" --out "$W/ds_autotuner" >> "$W/ds_autotuner.log" 2>&1
}

nvidia-smi --query-gpu=name,memory.total --format=csv > "$W/gpus.txt" 2>&1
if [ -n "${VERSUS:-}" ]; then  # DeepSpeed's autotuner on GPUs 0..G-1 (TUNED_TOO=1: then compare.py, tuned)
  deepspeeds "$VERSUS" "$G"
  [ "${TUNED_TOO:-0}" = 1 ] && step 110 python3 compare.py --gpus "$G" "${BASE[@]}" --micro_batch 8 --repeats 1 \
    --out "$W/tuned" > "$W/tuned.log" 2>&1
elif [ "$G" = 1 ]; then
  (CUDA_VISIBLE_DEVICES=1 ours 1) &
  (CUDA_VISIBLE_DEVICES=0 deepspeeds "$W/autotune/autotune.json" 1) &
  wait
else
  ours "$G"
fi
pkill -f plain_deepspeed/train.py; pkill -f lightning_app/train.py
# the bulky per-experiment folders of DeepSpeed's autotuner stay behind; its summary and configs come back
tar czf "$OUT/h200_tuning.tar.gz" -C "$W" --exclude='ds_autotuner/exps' --exclude='ds_autotuner/bin' .
echo "done in $(( SECONDS - T0 ))s"
