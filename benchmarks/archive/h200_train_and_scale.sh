#!/usr/bin/env bash
# One device call on nvidia-h200-x2 for the real-training, tuning and explain measurements:
#   1. the 350m preset trained on the shipped text (data/kjv.txt, byte-level) through both paths at once,
#      raw DeepSpeed on GPU 0 and Lightning on GPU 1, with validation and CSV logs (plot: benchmarks/plot_training.py)
#   2. compare.py on both GPUs, 1.5b ZeRO-3 bf16: the naive (original) config, the tuned profile, and the tuned
#      profile with compiled blocks, the fused bias paths and micro-batch 16 (the best of the 1-GPU ablation)
# Usage on the device machine, from the repo root:  bash benchmarks/h200_train_and_scale.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: h200_train_and_scale.sh OUTDIR}
W="$OUT/work"
mkdir -p "$W"
python3 -m shared.tools.prepare_data data/kjv.txt --out /tmp/kjv > "$W/prepare.log" 2>&1 || { cat "$W/prepare.log"; exit 1; }
TRAIN=(--preset 350m --data /tmp/kjv --vocab_size 256 --seq_len 512 --micro_batch 16 --steps ${KJV_STEPS:-1000} --warmup_steps 20
       --lr 6e-4 --min_lr 6e-5 --lr_warmup_steps 50 --val_every 50 --val_batches 16 --log_every 50
       --stage 3 --precision bf16 --zero_profile tuned
       --fused_bias_dropout_add false --fused_bias_gelu false)
CUDA_VISIBLE_DEVICES=0 timeout ${KJV_TIMEOUT:-240} python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
  plain_deepspeed/train.py "${TRAIN[@]}" --log_csv "$W/kjv350m_deepspeed.csv" --out "$W/kjv350m_deepspeed.json" \
  > "$W/kjv350m_deepspeed.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout ${KJV_TIMEOUT:-240} python3 lightning_app/train.py "${TRAIN[@]}" --devices 1 \
  --log_csv "$W/kjv350m_lightning.csv" --out "$W/kjv350m_lightning.json" > "$W/kjv350m_lightning.log" 2>&1 &
wait
[ -n "${KJV_ONLY:-}" ] && exit 0
tail -4 "$W/kjv350m_deepspeed.log" "$W/kjv350m_lightning.log"
CMP=(--gpus 2 --preset 1.5b --stage 3 --precision bf16 --steps 16 --warmup_steps 6)
timeout 110 python3 compare.py "${CMP[@]}" --micro_batch 8 --repeats 1 --zero_profile original \
  --fused_bias_dropout_add false --fused_bias_gelu false --out "$W/cmp2_naive"
timeout 110 python3 compare.py "${CMP[@]}" --micro_batch 8 --repeats 1 --zero_profile tuned --fused_bias_dropout_add false --fused_bias_gelu false \
  --out "$W/cmp2_tuned"
timeout 250 python3 compare.py "${CMP[@]}" --micro_batch 16 --repeats 2 --zero_profile tuned --compile blocks \
  --fused_bias_dropout_add --fused_bias_gelu --out "$W/cmp2_best"
tar czf "$OUT/h200_train_and_scale.tar.gz" -C "$W" --exclude runs .
tar czf "$OUT/runs.tar.gz" -C "$W" $(cd "$W" && ls -d cmp2_*/runs 2>/dev/null)
