"""The network: config, GPT, attention backends, layouts, fused ops, fused loss, FLOPs, the FP8 conversion. Imports
torch only (and shared.kernels; fp8.py imports torchao when it converts); nothing here imports DeepSpeed, Lightning or
shared.train."""
