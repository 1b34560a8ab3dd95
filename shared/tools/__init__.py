"""Command-line tools around training: prepare_data (text -> token files), generate (sample from an export),
export (either path's ZeRO checkpoint -> one .safetensors file), torchrun (torchrun whose stop by SIGTERM exits 143,
not 1 with a traceback)."""
