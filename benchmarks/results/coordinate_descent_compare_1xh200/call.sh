# One call of the compare with --coordinate_descent_tuning: PART=1 round 1 (raw, Lightning); PART=2.. continue it
# with --keep_runs (ceiling in round 1, round 2's pair). Caches kept on a warm machine, restored otherwise.
source .whl/activate.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_cache TORCH_EXTENSIONS_DIR=/tmp/tx
T0=$SECONDS; DEADLINE=${DEADLINE:-575}
left() { echo $(( DEADLINE - (SECONDS - T0) - 5 )); }
W=/tmp/cdtcmp; mkdir -p $W /tmp/ind_cache
echo "warm: $(ls /tmp/ind_cache | wc -l) cache entries, runs: $(ls $W/compare/runs 2>/dev/null | tr '\n' ' ')"
cp -rn devrun/bc/. /tmp/ind_cache/ 2>/dev/null
if [ ! -d $W/compare ] && [ -d devrun/compare ]; then cp -r devrun/compare $W/compare; echo "restored compare folder"; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > $W/gpus.txt 2>&1
python3 -c "
from shared.train.ds_runtime import normalize_cuda_arch_list; print(normalize_cuda_arch_list())
from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load(); print('dc op built')
" > $W/op_build_$PART.log 2>&1; echo "op build $(tail -1 $W/op_build_$PART.log) $((SECONDS-T0)) s"
if [ "$PART" = 1 ]; then R=(--repeats 1); else R=(--repeats 2 --keep_runs --reference ceiling --reference_rounds 1); fi
timeout -k 20 "$(left)" python3 compare.py --gpus 1 --preset 1.5b --stage 3 --precision bf16 --micro_batch 16 \
  --steps 20 --warmup_steps 10 --compile deepcompile --deepcompile_schedule once --profile_step 9 \
  --coordinate_descent_tuning "${R[@]}" --timeout 420 --out $W/compare > $W/compare_call$PART.log 2>&1
echo "compare rc=$? at $((SECONDS-T0)) s"; tail -30 $W/compare_call$PART.log
cd /tmp/ind_cache && find . -name '*.best_config' -print0 | tar czf $OUT/best_configs.tgz --null -T -
cd /tmp && tar czf $OUT/cdtcmp.tgz --exclude='*.pt.trace.json*' cdtcmp; ls -la $OUT
