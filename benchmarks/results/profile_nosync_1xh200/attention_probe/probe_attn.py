"""Probe: SDPA (cuDNN) causal attention with/without dropout at the 1.5b shape, contiguous BHTD inputs vs the
model's qkv views, alone and between matmuls (hot). Prints ms (CUDA events, median) fwd and fwd+bwd."""
import json, os, statistics, sys
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

B, H, T, D = 16, 24, 2048, 96
C = H * D
dev = "cuda"
torch.manual_seed(0)

def ev_time(fn, reps=30, warm=5, between=None):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        if between is not None:
            between()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts), min(ts), max(ts)

x_mm = torch.randn(B * T, C, device=dev, dtype=torch.bfloat16)
w_mm = torch.randn(4 * C, C, device=dev, dtype=torch.bfloat16)
def hot():  # the MLP's up and down projections' worth of matmul, ~a layer's matmul time
    y = x_mm @ w_mm.t()
    return y @ w_mm

def contiguous_inputs():
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    def fwd():
        return F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True)
    def fb():
        out = fwd(); torch.autograd.grad(out, (q, k, v), do)
    return fwd, fb

def model_views(contig=False):
    qkv = torch.randn(B, T, 3 * C, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, T, C, device=dev, dtype=torch.bfloat16)
    def fwd():
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        if contig:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, C)
    def fb():
        out = fwd(); torch.autograd.grad(out, (qkv,), do)
    return fwd, fb

rows = []
for P in (0.0, 0.1):
    for name, make in (("contiguous BHTD", contiguous_inputs), ("model views", model_views),
                       ("model views .contiguous()", lambda: model_views(True))):
        fwd, fb = make()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for hot_name, between in (("cold", None), ("hot", hot)):
                f = ev_time(fwd, between=between)
                g = ev_time(fb, between=between)
                row = {"dropout": P, "inputs": name, "regime": hot_name, "fwd_ms": f, "fwd_bwd_ms": g}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del fwd, fb
        torch.cuda.empty_cache()

# kernels of the model-view run, with dropout
from torch.profiler import profile, ProfilerActivity
P = 0.1
fwd, fb = model_views()
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(3): fb()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): fb()
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
fwd, fb = contiguous_inputs()
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(3): fb()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): fb()
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
out = os.environ.get("OUT", ".")
json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name(),
           "rows": rows}, open(os.path.join(out, "probe_attn.json"), "w"), indent=1)
