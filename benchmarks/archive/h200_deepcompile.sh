#!/usr/bin/env bash
# DeepCompile on the H200s, one device call per STAGE (nvidia-h200-x2), every step bounded so the call ends
# inside the device's 10 minutes; results are packed into OUTDIR/deepcompile_<stage>.tar.gz.
#   STAGE=one   GPU 0: 1-GPU compare (both paths, --compile deepcompile, ceiling + FSDP2 rows);
#               GPU 1: the deepcompile GPU tests (tests/test_deepcompile.py -m gpu)
#   STAGE=pair  1-GPU compare with --parallel: each pair's two paths at once on GPUs 0 and 1, then the ceiling
#               and FSDP2 rows likewise (a DeepCompile run of the 1.5b preset warms up for ~5 min)
#   STAGE=tests GPU 0: the deepcompile GPU tests; GPU 1: compare.py --explain (eager, tuned, micro-batch 8)
#   STAGE=two   2-GPU compare (both paths, deepcompile, ceiling on GPU 0 + FSDP2 on both)
#   STAGE=explain  GPU 0: 1-GPU compare as in `one`; GPU 1: compare.py --explain as in `tests`
#   STAGE=eachtest  the deepcompile GPU tests one pytest each, two streams (GPU 0 and 1)
#   STAGE=profile  GPU 0: one raw DeepCompile run with SCHED, then the ZeRO-3 optimizer step's
#               profile (benchmarks/optimizer_step.py, torch AdamW); GPU 1: explain
#   STAGE=probe GPU 0: the Lightning DeepCompile resume GPU test, then attention with and without dropout (each SDPA
#               kernel and blocksparse, the model's shape at micro-batch 16); GPU 1: the ceiling with the vocabulary
#               unpadded and padded to 128, alternated VOCAB_ROUNDS times, then the ZeRO-3 optimizer step (fast vs
#               DeepSpeed); on a one-GPU machine all of it on GPU 0, one after the other
#   STAGE=split a GPUS-GPU compare (default 1) over two calls: KEEP unset runs round 1 (both paths, ceiling, FSDP2;
#               --repeats 1); KEEP=<the first call's compare_<GPUS>xh200 folder, in the repo> continues it with
#               --repeats 2 --keep_runs (round 2's pair), then, on one GPU, the Lightning DeepCompile resume test
#   STAGE=steps GPU 0: the ZeRO-3 optimizer step, --zero3_step STEP_MODES (default "fast deepspeed") alternated
#               (STEP_ROUNDS rounds);
#               GPU 1: the deepcompile GPU tests named in TESTS, one pytest each
#   STAGE=fusedstep  GPU 0: one sub-group's step alone, fast against fused (benchmarks/adamw_step.py), the ZeRO-3
#               optimizer step with --zero3_step fast and fused (STEP_ROUNDS rounds, default 1), then the last-mile
#               ablation's -fused_zero3_step and baseline (CONFIGS, space-separated), one ablation.py each
#   STAGE=lastmile  the block-sparse kernel's GPU tests (TEST_K selects, default those with dropout), attention
#               with and without dropout as in `probe` (plus flex), then benchmarks/ablation.py --set last_mile over
#               CONFIGS (comma-separated) with --keep; ABL=<an earlier call's ablation folder, in the repo> continues it;
#               PARTS picks and orders the parts (default "kernel attention ablation")
#   STAGE=persist  raw DeepCompile runs of BASE alternating --deepcompile_persist threshold and deepspeed (ORDER,
#               default "threshold deepspeed threshold"), step PROFILE_STEP (default 9) profiled; then, in what is
#               left, the ceiling with the same profiled step (as measured: SCHED=once STEPS=14)
#   STAGE=autotune  compare.py --autotune on GPUS GPUs (default 1) over GRID (default 16,24), each candidate STEPS /
#               WARMUP steps, its budget what is left of the call; KEEP=<an earlier call's autotune folder, in the repo>
#               continues that search (--keep_runs): candidates measured there are not run again
#   STAGE=lever benchmarks/ablation.py --set last_mile over CONFIGS (comma-separated) at micro-batch MB (default 16)
#               on GPUS GPUs (default 1; more: --gpus, each GPU running its own baselines), step PROFILE_STEP
#               (default 9) profiled as a step in flight runs, as many runs as fit before the TESTS_S seconds
#               kept for TESTS (pytest node ids, gpu marker), which run after the timed runs on GPU 0; KEEP=warm
#               continues the ablation from the copy the last call left in /tmp on the same machine (calls back to
#               back), KEEP=<an earlier call's ablation folder, in the repo> from that folder
#   STAGE=headline  compare.py's GPU default on GPUS GPUs (default 1): both paths, REPEATS rounds (default 2), the
#               ceiling in round 1, step PROFILE_STEP (default 9) profiled, over as many calls as it takes: each call
#               runs what fits in it (--time_limit; exit status 3 when it stopped before a run) and KEEP=<the last
#               call's headline_<GPUS>xh200 folder, in the repo> continues it (--keep_runs) until the report is written;
#               KEEP=warm continues from the copy the last call left in /tmp on the same machine (calls back to back
#               keep the machine, and with it the compile cache) and stops if the machine is a fresh one; TESTS
#               (pytest node ids, gpu marker) run after compare.py, in the TESTS_S seconds kept for them
#   STAGE=dropout  the dropout-mask kernel's GPU tests and benchmarks/residual_dropout.py at the 1.5b shape (without
#               coordinate-descent tuning, which takes minutes to compile there), then benchmarks/ablation.py --set
#               last_mile over CONFIGS (default baseline,-triton_dropout,baseline_again), step PROFILE_STEP (default 9)
#               profiled, as many runs as fit (--time_limit); KEEP=warm continues that ablation from the copy the last
#               call left in /tmp on the same machine (calls back to back) and skips the tests and the benchmark
# SCHED picks --deepcompile_schedule (deepspeed | once); EXTRA adds flags to every training run (e.g. "--profile_step
# 9"); TESTS names the deepcompile GPU tests of `steps` and of `split`'s second call; FACTORS the explain factors;
# REFROUNDS runs the reference rows of `pair`/`two` in the first N rounds only (compare.py --reference_rounds).
# Usage on the device machine, from the repo root: STAGE=one bash benchmarks/h200_deepcompile.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: h200_deepcompile.sh OUTDIR}
STAGE=${STAGE:-one}
W=${WORK:-/tmp/h200_deepcompile}
rm -rf "$W"; mkdir -p "$W"
# Caches shared by every run of the call: DeepSpeed's JIT op (DeepCompile's `dc`), inductor's graphs and kernels,
# Triton's binaries. A fresh machine starts from inductor's and Triton's as an earlier call saved them
# (benchmarks/compile_cache.py) when .compile_cache/ (the files it wrote into that call's OUTDIR) came with the repo;
# each call saves its own at the end into OUTDIR (SAVE_CACHE=0: not).
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/zero3bench_extensions}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/zero3bench_inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/zero3bench_triton}
T0=$SECONDS
if [ -d .compile_cache ]; then
  timeout 120 python3 benchmarks/compile_cache.py restore .compile_cache 2>&1 | tee "$W/compile_cache.log"
fi
WARM=/tmp/keep_headline_${GPUS:-1}xh200  # the headline folder the last call left on this machine
if [ "$STAGE" = headline ] && [ "${KEEP:-}" = warm ]; then
  KEEP=$WARM
  [ -d "$KEEP" ] || { echo "KEEP=warm: no $KEEP on this machine (a fresh one); KEEP=<the folder, in the repo>"
                      exit 2; }
fi
DEADLINE=${DEADLINE_S:-565}
left() { echo $(( DEADLINE - (SECONDS - T0) - 8 )); }
MB=${MB:-16}
BASE=(--preset 1.5b --stage 3 --precision bf16 --micro_batch "$MB" --steps "${STEPS:-20}" --warmup_steps "${WARMUP:-10}"
      --compile deepcompile --deepcompile_schedule "${SCHED:-deepspeed}" ${EXTRA:-})
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > "$W/gpus.txt" 2>&1
# Build DeepCompile's op and its device-wait variant (--deepcompile_backward_wait device) once, side by side, before
# any run races for them (the image's TORCH_CUDA_ARCH_LIST=9.0a is handled).
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > "$W/op_build.log" 2>&1 &
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from shared.train.deepcompile_op import builder; builder().load(); print('dc_device_wait op built')
" > "$W/op_build_device_wait.log" 2>&1
wait
echo "op build: $(tail -1 "$W/op_build.log"); $(tail -1 "$W/op_build_device_wait.log") at $((SECONDS - T0)) s"
# The streams a stage is made of; each takes the GPU it runs on, every one bounded by what is left of the call.
compare_one() {  # 1-GPU compare, both paths with DeepCompile, ceiling + FSDP2 rows
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 compare.py --gpus 1 "${BASE[@]}" \
    --repeats "${REPEATS:-1}" --reference --timeout 400 --out "$W/compare_1xh200" > "$W/compare_1xh200.log" 2>&1
}
gpu_tests() {  # the deepcompile GPU tests; $2...: pytest flags
  local gpu=$1; shift
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 "$(left)" python3 -m pytest -m gpu tests/test_deepcompile.py -v "$@" \
    -p no:cacheprovider > "$W/gpu_tests_deepcompile.log" 2>&1
}
explain_one() {  # compare.py --explain, eager, tuned profile, micro-batch 8, 2 rounds per factor
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 compare.py --gpus 1 --explain --compile none \
    --preset 1.5b --micro_batch 8 --steps 14 --warmup_steps 5 --factor_repeats 2 \
    --factors "${FACTORS:-ds_throughput_timer,original_ds_config,progress_bar,log_loss,python_gc_auto}" \
    --out "$W/explain_1xh200" > "$W/explain_1xh200.log" 2>&1
}
raw_dc() {  # one raw DeepCompile run of BASE on GPU $1
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    plain_deepspeed/train.py "${BASE[@]}" --out "$W/raw_dc_${SCHED:-deepspeed}.json" > "$W/raw_dc.log" 2>&1
}
optimizer_profile() {  # where the ZeRO-3 optimizer step's time goes (torch AdamW)
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 benchmarks/optimizer_step.py --preset 1.5b --stage 3 \
    --precision bf16 --micro_batch 4 --steps 11 --warmup_steps 3 \
    --out "$W/optimizer_step_adamw.json" > "$W/optimizer_step_adamw.log" 2>&1
}
zero3_steps() {  # GPU $1: the ZeRO-3 optimizer step, each of STEP_MODES (default: fast and DeepSpeed's) alternated
  for r in $(seq 0 $(( ${STEP_ROUNDS:-2} - 1 ))); do
    for mode in ${STEP_MODES:-fast deepspeed}; do
      CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 benchmarks/optimizer_step.py --preset 1.5b --stage 3 \
        --precision bf16 --micro_batch 4 --steps 11 --warmup_steps 3 --zero3_step $mode \
        --out "$W/optimizer_step_${mode}_$r.json" > "$W/optimizer_step_${mode}_$r.log" 2>&1
    done
  done
}
vocab_probe() {  # GPU $1: the ceiling row, --vocab_multiple 1 and 128 alternated (VOCAB_ROUNDS rounds)
  for r in $(seq 0 $(( ${VOCAB_ROUNDS:-2} - 1 ))); do
    for m in 1 128; do
      CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
        benchmarks/reference.py --mode ceiling --preset 1.5b --precision bf16 --micro_batch "$MB" --steps 20 \
        --warmup_steps 10 --vocab_multiple $m --out "$W/ceiling_vocab${m}_$r.json" > "$W/ceiling_vocab${m}_$r.log" 2>&1
    done
  done
}
attention_dropout() {  # GPU $1: attention forward + backward at the 1.5b model's shape, dropout 0 and 0.1
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 benchmarks/attention.py --quick --layouts causal \
    --batch "$MB" --backends blocksparse flex sdpa sdpa:flash sdpa:efficient sdpa:cudnn --dropouts 0 0.1 \
    --out "$W/attention_dropout.json" > "$W/attention_dropout.log" 2>&1
}
kernel_tests() {  # GPU $1: the block-sparse kernel's GPU tests
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 -m pytest -m gpu tests/test_blocksparse.py -v -rA \
    -k "${TEST_K:-dropout and not no_dropout}" -p no:cacheprovider > "$W/gpu_tests_blocksparse.log" 2>&1
}
last_mile() {  # GPU $1: the lever table on top of the DeepCompile default (benchmarks/ablation.py --set last_mile)
  if [ -n "${ABL:-}" ]; then cp -r "$ABL" "$W/ablation"; fi
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 benchmarks/ablation.py --set last_mile \
    --configs "${CONFIGS:-baseline,+mb24}" --keep --timeout 400 --out "$W/ablation" > "$W/ablation.log" 2>&1
}
REFS=(--reference ${REFROUNDS:+--reference_rounds "$REFROUNDS"})
gpu_test_each() {  # GPU $1: each named deepcompile GPU test in its own pytest, so every one reports even if cut
  local gpu=$1; shift
  for t in "$@"; do
    CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 "$(left)" python3 -m pytest -m gpu "tests/test_deepcompile.py::$t" -v -s \
      --tb=short -p no:cacheprovider >> "$W/gpu_tests_deepcompile_$gpu.log" 2>&1
  done
}
persist_runs() {  # GPU $1: the persistence lever against DeepSpeed's lifetimes, each run its own files
  local i=0 mode
  for mode in ${ORDER:-threshold deepspeed threshold}; do
    CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
      plain_deepspeed/train.py "${BASE[@]}" --profile_step "${PROFILE_STEP:-9}" --deepcompile_persist "$mode" \
      --out "$W/persist_${i}_$mode.json" > "$W/persist_${i}_$mode.log" 2>&1
    i=$((i + 1))
  done
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    benchmarks/reference.py --mode ceiling --preset 1.5b --precision bf16 --micro_batch "$MB" --steps "${STEPS:-20}" \
    --warmup_steps "${WARMUP:-10}" --profile_step "${PROFILE_STEP:-9}" --out "$W/persist_ceiling.json" \
    > "$W/persist_ceiling.log" 2>&1
}
case "$STAGE" in
  persist) persist_runs 0 ;;
  probe)
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      (gpu_test_each 0 "test_deepcompile_validates_saves_exports_and_resumes_at_the_end[lightning]"
       attention_dropout 0) &
      (vocab_probe 1; STEP_ROUNDS=${STEP_ROUNDS:-1} zero3_steps 1) & wait
    else  # one GPU: the same, one after the other
      gpu_test_each 0 "test_deepcompile_validates_saves_exports_and_resumes_at_the_end[lightning]"
      vocab_probe 0; attention_dropout 0; STEP_ROUNDS=${STEP_ROUNDS:-1} zero3_steps 0
    fi ;;
  lastmile)
    for part in ${PARTS:-kernel attention ablation}; do
      case $part in kernel) kernel_tests 0 ;; attention) attention_dropout 0 ;; ablation) last_mile 0 ;;
        *) echo "unknown part $part (kernel, attention, ablation)"; exit 2 ;; esac
    done ;;
  resume)
    gpu_test_each 0 "test_deepcompile_validates_saves_exports_and_resumes_at_the_end[raw]" &
    gpu_test_each 1 "test_deepcompile_validates_saves_exports_and_resumes_at_the_end[lightning]" & wait ;;
  eachtest)
    gpu_test_each 0 test_both_paths_train_with_deepcompile_and_compile_the_same_graphs \
      test_the_once_schedule_trains_like_deepspeeds_schedule &
    gpu_test_each 1 test_deepcompile_applies_dropout_like_the_eager_model \
      "test_deepcompile_validates_saves_exports_and_resumes_at_the_end[raw]" & wait ;;
  profile) (raw_dc 0; optimizer_profile 0) & explain_one 1 & wait ;;
  steps) zero3_steps 0 & gpu_test_each 1 ${TESTS:-} & wait ;;
  fusedstep)
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 120 python3 benchmarks/adamw_step.py --repeats 7 --out "$W/adamw_step.json" \
      > "$W/adamw_step.log" 2>&1
    STEP_ROUNDS=${STEP_ROUNDS:-1} STEP_MODES="fast fused" zero3_steps 0
    # one ablation.py per configuration (--keep), so that a cold first run does not stop the second by its length;
    # the second shares the first's compiled graph (the step is outside it), so it warms up faster
    for c in ${CONFIGS:--fused_zero3_step baseline}; do
      CUDA_VISIBLE_DEVICES=0 timeout -k 25 "$(left)" python3 benchmarks/ablation.py --set last_mile --configs="$c" \
        --keep --timeout 400 --out "$W/ablation" >> "$W/ablation.log" 2>&1
    done ;;
  one) compare_one 0 & gpu_tests 1 -x & wait ;;
  explain) compare_one 0 & explain_one 1 & wait ;;
  tests) gpu_tests 0 -rA & explain_one 1 & wait ;;
  split)
    G=${GPUS:-1}; C="compare_${G}xh200"
    if [ -n "${KEEP:-}" ]; then cp -r "$KEEP" "$W/$C"; R=2; K=(--keep_runs); else R=1; K=(); fi
    timeout -k 10 "$(left)" python3 compare.py --gpus "$G" "${BASE[@]}" --repeats $R --reference --reference_rounds 1 \
      "${K[@]}" --timeout 400 --out "$W/$C" > "$W/$C.log" 2>&1
    if [ -n "${KEEP:-}" ] && [ "$G" = 1 ]; then
      gpu_test_each 0 ${TESTS:-"test_deepcompile_validates_saves_exports_and_resumes_at_the_end[lightning]"}
    fi ;;
  dropout)
    A=/tmp/keep_ablation_dropout  # the ablation the last call left on this machine
    if [ "${KEEP:-}" = warm ]; then
      [ -d "$A" ] || { echo "KEEP=warm: no $A on this machine (a fresh one)"; exit 2; }
      cp -r "$A" "$W/ablation"
    else
      CUDA_VISIBLE_DEVICES=0 timeout -k 5 120 python3 -m pytest -m gpu -v tests/test_dropout_mask.py \
        -p no:cacheprovider > "$W/gpu_tests_dropout_mask.log" 2>&1
      CUDA_VISIBLE_DEVICES=0 timeout -k 5 180 python3 benchmarks/residual_dropout.py --coordinate_descent_tuning false \
        --out "$W/residual_dropout.json" > "$W/residual_dropout.log" 2>&1
    fi
    CUDA_VISIBLE_DEVICES=0 timeout -k 25 "$(left)" python3 benchmarks/ablation.py --set last_mile \
      --configs "${CONFIGS:-baseline,-triton_dropout,baseline_again}" --profile_step "${PROFILE_STEP:-9}" --keep \
      --timeout 400 --time_limit "$(( $(left) - 20 ))" --out "$W/ablation" > "$W/ablation.log" 2>&1
    echo "ablation exit $? (3: stopped before a run that would not fit; KEEP=warm continues it)"
    rm -rf "$A" && cp -r "$W/ablation" "$A" ;;
  lever)
    A=/tmp/keep_ablation_lever  # the ablation the last call left on this machine
    if [ "${KEEP:-}" = warm ]; then
      [ -d "$A" ] || { echo "KEEP=warm: no $A on this machine (a fresh one)"; exit 2; }
      cp -r "$A" "$W/ablation"
    elif [ -n "${KEEP:-}" ]; then
      cp -r "$KEEP" "$W/ablation" || { echo "KEEP=$KEEP: no such ablation folder"; exit 2; }
    fi
    G=${GPUS:-1}  # GPUs the runs are spread over (ablation.py --gpus), from GPU 0
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(( G - 1 ))) timeout -k 25 "$(left)" python3 benchmarks/ablation.py \
      --set last_mile --gpus "$G" --micro_batch "$MB" \
      --configs="${CONFIGS:?CONFIGS=<comma-separated configurations>}" --profile_step "${PROFILE_STEP:-9}" \
      --profile_sync false --keep --timeout 400 --time_limit "$(( $(left) - 20 - ${TESTS_S:-0} ))" \
      --out "$W/ablation" > "$W/ablation.log" 2>&1
    echo "ablation exit $? (3: stopped before a run that would not fit; KEEP=warm continues it)"
    rm -rf "$A" && cp -r "$W/ablation" "$A"
    if [ -n "${TESTS:-}" ]; then  # GPU tests after the timed runs, in the TESTS_S seconds kept for them
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$(left)" python3 -m pytest -m gpu -v $TESTS -p no:cacheprovider \
        > "$W/gpu_tests_lever.log" 2>&1
    fi ;;
  headline)
    G=${GPUS:-1}; C="headline_${G}xh200"
    if [ -n "${KEEP:-}" ]; then cp -r "$KEEP" "$W/$C"; fi
    # compare.py stops between runs by itself; the outer timeout only guards a first run longer than the call
    timeout -k 25 "$(left)" python3 compare.py --gpus "$G" --preset 1.5b --stage 3 --precision bf16 \
      --steps "${STEPS:-20}" --warmup_steps "${WARMUP:-10}" --profile_step "${PROFILE_STEP:-9}" ${EXTRA:-} \
      --repeats "${REPEATS:-2}" --reference ceiling --reference_rounds 1 --keep_runs \
      --time_limit "$(( $(left) - 20 - ${TESTS_S:-0} ))" --timeout 400 --out "$W/$C" > "$W/$C.log" 2>&1
    echo "compare exit $? (3: stopped before a run that would not fit; KEEP=warm or KEEP=<this folder> continues it)"
    rm -rf "$WARM.new" && cp -r "$W/$C" "$WARM.new" && rm -rf "$WARM" && mv "$WARM.new" "$WARM"
    if [ -n "${TESTS:-}" ]; then  # GPU tests after the timed runs, in the TESTS_S seconds kept for them
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$(left)" python3 -m pytest -m gpu -v $TESTS -p no:cacheprovider \
        > "$W/gpu_tests_headline.log" 2>&1
    fi ;;
  autotune)
    if [ -n "${KEEP:-}" ]; then cp -r "$KEEP" "$W/autotune"; K=(--keep_runs); else K=(); fi
    # -k 25: compare.py's own SIGTERM handler takes up to 15 s to stop the candidate it runs
    timeout -k 25 "$(( $(left) - 15 ))" python3 compare.py --gpus "${GPUS:-1}" --preset 1.5b --stage 3 --precision bf16 \
      --steps "${STEPS:-20}" --warmup_steps "${WARMUP:-10}" ${EXTRA:-} --autotune --mb_grid "${GRID:-16,24}" \
      --budget_s "$(( $(left) - 35 ))" "${K[@]}" --timeout 400 --out "$W/autotune" > "$W/autotune.log" 2>&1
    pkill -f plain_deepspeed/train.py ;;
  pair)
    timeout -k 10 "$(left)" python3 compare.py --gpus 1 --parallel "${BASE[@]}" --repeats "${REPEATS:-1}" \
      "${REFS[@]}" --timeout 500 --out "$W/compare_1xh200" > "$W/compare_1xh200.log" 2>&1 ;;
  two)
    timeout -k 10 "$(left)" python3 compare.py --gpus 2 "${BASE[@]}" --repeats "${REPEATS:-2}" "${REFS[@]}" \
      --timeout 400 --out "$W/compare_2xh200" > "$W/compare_2xh200.log" 2>&1 ;;
  *) echo "unknown STAGE $STAGE"; exit 2 ;;
esac
echo "done at $((SECONDS - T0)) s"
for f in "$W"/*.log; do echo "== $f"; tail -25 "$f"; done
tar czf "$OUT/deepcompile_$STAGE.tar.gz" -C "$W" .
# last, after the results are packed: in what is left of the device's 10 minutes (DEADLINE_S keeps ~35 s of them)
SAVE_S=$(( DEADLINE + 15 - (SECONDS - T0) ))
if [ "${SAVE_CACHE:-1}" != 1 ]; then :
elif [ "$SAVE_S" -ge 10 ]; then timeout "$SAVE_S" python3 benchmarks/compile_cache.py save "$OUT"
else echo "compile cache: not saved, $SAVE_S s left"; fi
