"""Command-line tools around training: prepare_data (text -> token files), generate (sample from an export),
export (either path's ZeRO checkpoint -> one .safetensors file)."""
