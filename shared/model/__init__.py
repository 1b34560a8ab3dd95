"""The network: config, GPT, attention backends, layouts, fused ops, fused loss, FLOPs. Imports torch only
(and shared.kernels); nothing here imports DeepSpeed, Lightning or shared.train."""
