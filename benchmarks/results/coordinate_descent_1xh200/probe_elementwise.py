"""probe: what the block's elementwise kernels cost, and which change makes them cheaper (bf16, B*T=32768)."""
import json, os, statistics, sys, time
import torch, torch.nn.functional as F
import triton, triton.language as tl

N, H, FF = 32768, 2304, 9216
dev, dt = "cuda", torch.bfloat16
P = 0.1

@triton.jit
def keep_kernel(out_ptr, n, seed_ptr, thr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    seed = tl.load(seed_ptr)
    i = tl.arange(0, BLOCK)
    c = pid * BLOCK + i
    r0, r1, r2, r3 = tl.randint4x(seed, c)
    base = pid * 4 * BLOCK + i
    tl.store(out_ptr + base, (r0 >> 8).to(tl.int32) >= thr, mask=base < n)
    tl.store(out_ptr + base + BLOCK, (r1 >> 8).to(tl.int32) >= thr, mask=base + BLOCK < n)
    tl.store(out_ptr + base + 2 * BLOCK, (r2 >> 8).to(tl.int32) >= thr, mask=base + 2 * BLOCK < n)
    tl.store(out_ptr + base + 3 * BLOCK, (r3 >> 8).to(tl.int32) >= thr, mask=base + 3 * BLOCK < n)

@torch.library.custom_op("probe::keep_mask", mutates_args=())
def keep_mask(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    n = out.numel(); B = 1024
    keep_kernel[(triton.cdiv(n, 4 * B),)](out, n, seed, int(round(p * 2 ** 24)), BLOCK=B)
    return out

@keep_mask.register_fake
def _(x, seed, p):
    return torch.empty(x.shape, dtype=torch.bool, device=x.device)

def blk(x, b, r, w, lb):
    h = r + F.dropout(x + b, P, True)
    return h, F.layer_norm(h, (H,), w, lb)

def blk_nodrop(x, b, r, w, lb):
    h = r + (x + b)
    return h, F.layer_norm(h, (H,), w, lb)

def blk_mask(x, b, r, w, lb):
    seed = torch.randint(0, 2 ** 31, (1,), device=x.device)
    m = torch.ops.probe.keep_mask(x, seed, P)
    h = r + (x + b) * m * (1.0 / (1.0 - P))
    return h, F.layer_norm(h, (H,), w, lb)

def gelu(x, b):
    return (F.gelu(x + b, approximate="tanh"),)

def timeit(fn, args, grads, iters=25):
    ev = []
    for i in range(iters + 5):
        s, e, m = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        s.record()
        outs = fn(*args)
        m.record()
        torch.autograd.backward(outs, grads)
        e.record()
        torch.cuda.synchronize()
        if i >= 5:
            ev.append((s.elapsed_time(m), m.elapsed_time(e)))
        for a in args:
            a.grad = None
    f = statistics.median(x[0] for x in ev); bw = statistics.median(x[1] for x in ev)
    return {"fwd_ms": round(f, 4), "bwd_ms": round(bw, 4), "spread_fwd": [round(min(x[0] for x in ev), 4), round(max(x[0] for x in ev), 4)]}

torch.manual_seed(0)
x = torch.randn(N, H, device=dev, dtype=dt, requires_grad=True)
r = torch.randn(N, H, device=dev, dtype=dt, requires_grad=True)
b = torch.randn(H, device=dev, dtype=dt, requires_grad=True)
w = torch.ones(H, device=dev, dtype=dt, requires_grad=True)
lb = torch.zeros(H, device=dev, dtype=dt, requires_grad=True)
g2 = [torch.randn(N, H, device=dev, dtype=dt), torch.randn(N, H, device=dev, dtype=dt)]
xf = torch.randn(N, FF, device=dev, dtype=dt, requires_grad=True)
bf = torch.randn(FF, device=dev, dtype=dt, requires_grad=True)
g1 = [torch.randn(N, FF, device=dev, dtype=dt)]

# eager mask kernel alone, and its keep rate
seed = torch.tensor([1234], device=dev)
m = keep_mask(x, seed, P); torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(50): keep_mask(x, seed, P)
torch.cuda.synchronize()
res = {"mask_kernel_ms": round((time.perf_counter() - t0) / 50 * 1e3, 4), "keep_rate": m.float().mean().item()}
t0 = time.perf_counter()
for _ in range(50): torch.rand_like(x) > P
torch.cuda.synchronize()
res["aten_rand_gt_ms"] = round((time.perf_counter() - t0) / 50 * 1e3, 4)
print(res, flush=True)

variants = [
    ("ln_dropout_inductor", blk, {}),
    ("ln_nodropout", blk_nodrop, {}),
    ("ln_dropout_fallback_random", blk, {"fallback_random": True}),
    ("ln_dropout_mask_op", blk_mask, {}),
    ("ln_dropout_coord_descent", blk, {"coordinate_descent_tuning": True}),
    ("ln_dropout_multi_kernel", blk, {"triton.multi_kernel": 1}),
    ("ln_mask_op_coord_descent", blk_mask, {"coordinate_descent_tuning": True}),
    ("gelu_inductor", gelu, {}),
    ("gelu_coord_descent", gelu, {"coordinate_descent_tuning": True}),
]
for name, fn, opts in variants:
    torch._dynamo.reset()
    t0 = time.time()
    c = torch.compile(fn, options=opts or None, dynamic=False)
    try:
        if name.startswith("gelu"):
            out = timeit(c, (xf, bf), g1)
        else:
            out = timeit(c, (x, b, r, w, lb), g2)
    except Exception as e:
        out = {"error": repr(e)[:300]}
    out["wall_s"] = round(time.time() - t0, 1)
    res[name] = out
    print(name, out, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_elementwise.json"), "w"), indent=1)
