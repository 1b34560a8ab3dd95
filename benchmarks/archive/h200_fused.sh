#!/usr/bin/env bash
# The fused-kernel measurements in one device call on nvidia-h200-x2:
#   1. the gpu-marked tests of the fused paths (bf16 keep-rate/mask, bias-GELU)
#   2. benchmarks/ablation.py: 1.5b, ZeRO-3 bf16, micro-batch 8, both paths (raw on GPU 0, Lightning on GPU 1)
# Usage on the device machine, from the repo root:  bash benchmarks/h200_fused.sh OUTDIR [ablation args...]
set -uo pipefail
OUT=${1:?usage: h200_fused.sh OUTDIR}
shift
W="$OUT/work"
mkdir -p "$W"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$W/nvidia-smi.txt"
timeout 150 python3 -m pytest -v -m gpu tests/test_fused_ops.py > "$W/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$W/gpu_tests.log"
timeout 460 python3 benchmarks/ablation.py --preset 1.5b --micro_batch 8 --out "$W/ablation" "$@"
echo "ablation rc=$?"
tar czf "$OUT/h200_fused.tar.gz" -C "$W" .
