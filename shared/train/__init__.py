"""What both training loops use: run config, CLI, data, DeepSpeed dict, optimizer, distributed set-up, checkpoints,
progress, timing and results. DeepSpeed is imported only inside functions; Lightning never."""
