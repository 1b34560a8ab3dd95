#!/usr/bin/env bash
# The first Lightning vs DeepSpeed compare measurements on H200s, one device call:
#   1. the raw path alone, launched as the original study did (deepspeed launcher), 1.5b, ZeRO-3 bf16, mb 8
#   2. compare.py on 1 GPU (interleaved repeats, plus a DeepSpeed wall_clock_breakdown cross-check)
#   3. compare.py on 2 GPUs
# (fused bias paths off: these runs predate them, and they are on by default on GPUs now)
# Usage on the device machine, from the repo root:  bash benchmarks/h200_compare.sh OUTDIR
# Everything lands in OUTDIR (packed as OUTDIR/h200_compare.tar.gz for the trip back).
set -uo pipefail
OUT=${1:?usage: h200_compare.sh OUTDIR}
mkdir -p "$OUT/work"
W="$OUT/work"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$W/nvidia-smi.txt"
python3 -c "import torch, deepspeed, pytorch_lightning as pl; print(torch.__version__, torch.version.cuda, deepspeed.__version__, pl.__version__)"
NG=$(python3 -c "import torch; print(torch.cuda.device_count())")

echo "== raw path, deepspeed launcher, 1 GPU"
timeout 240 deepspeed --num_gpus 1 plain_deepspeed/train.py --preset 1.5b --stage 3 --precision bf16 \
  --micro_batch 8 --steps 30 --warmup_steps 10 --zero_profile original --fused_bias_dropout_add false --fused_bias_gelu false --out "$W/raw_1.5b_zero3_bf16_mb8_1gpu.json" \
  > "$W/raw_1gpu.log" 2>&1; echo "rc=$?"; tail -12 "$W/raw_1gpu.log"

echo "== compare, 1 GPU"
timeout 330 python3 compare.py --gpus 1 --preset 1.5b --stage 3 --precision bf16 --micro_batch 8 --steps 25 \
  --warmup_steps 8 --repeats 2 --zero_profile original --fused_bias_dropout_add false --fused_bias_gelu false --cross-check --out "$W/compare_1gpu"; echo "rc=$?"

if [ "$NG" -ge 2 ]; then
  echo "== compare, 2 GPUs"
  timeout 240 python3 compare.py --gpus 2 --preset 1.5b --stage 3 --precision bf16 --micro_batch 8 --steps 25 \
    --warmup_steps 8 --repeats 2 --zero_profile original --fused_bias_dropout_add false --fused_bias_gelu false --out "$W/compare_2gpu"; echo "rc=$?"
fi
tar czf "$OUT/h200_compare.tar.gz" -C "$W" .
