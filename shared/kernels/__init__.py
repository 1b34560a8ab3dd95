"""The project's Triton kernels, each with a PyTorch (or NumPy) reference that its tests compare it with."""


def require_cuda_or_interpreter(op: str, device, interpreted: bool, flag: str) -> None:
    """Raise ValueError naming `op` and the `flag` that asked for it unless its Triton kernel can run on `device`:
    a CUDA device, or a CPU under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)."""
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"{op} runs a Triton kernel on CUDA tensors, got {device}; on a CPU set TRITON_INTERPRET=1 "
                         f"before triton is imported to run it in Triton's interpreter, or drop {flag}")
