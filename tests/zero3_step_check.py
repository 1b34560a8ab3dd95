"""Run under torchrun by tests/test_zero3_step.py: the fast ZeRO-3 step against DeepSpeed's own, on the same grads.

On each rank, after one backward of the tiny GPT under ZeRO-3: DeepSpeed's gradient norm and fp32 gradient copy
are computed first (their originals), then the fast ones on the same gradients; then engine.step() must run the
fast code and report the same global norm. Then, with torch's fused AdamW (which has a CPU kernel), six training steps
with the fast, with DeepSpeed's and with the fused step (the AdamW kernel, in Triton's interpreter), clipping on
and off: the fast one hands the unscale to the optimizer, the fused one to the kernel.
Last, the step's eager gather of ZeRO-3's persistent parameters, as it runs once DeepCompile has turned persistence
off (shared/patches/deepcompile.drop_eager_persistent): gathered after each step with the list, not without it; and
the cached walks (deepcompile.cache_deepcompile_walks) against DeepSpeed's own on the same parameter states.
Writes the figures of rank 0 to argv[1] (JSON); argv[2] is the token files' prefix the equivalence runs train on.
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from shared.model.gpt import GPT
from shared.patches import deepcompile, zero3_step
from shared.patches.deepcompile import cache_deepcompile_walks, drop_eager_persistent
from shared.train.config import TrainConfig
from shared.train.data import train_loader
from shared.train.distributed import ensure_env, exit_process, seed_all
from shared.train.ds_config import build_ds_config
from shared.train.ds_runtime import param_checksum
from shared.train.optim import build_optimizer, build_scheduler, param_groups


def build_engine(train: TrainConfig, make_optimizer):
    """The tiny GPT under ZeRO-3 (seeded, built inside zero.Init) with the optimizer make_optimizer(model) gives."""
    ds_config = build_ds_config(train)
    seed_all(train.seed)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = GPT(train.model())
    optimizer = make_optimizer(model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           lr_scheduler=build_scheduler(optimizer, train), dist_init_required=False)
    return engine


# The equivalence runs train: 6 steps on text (argv[2], KJV's bytes; on synthetic tokens the loss starts at its floor,
# ln 256) at lr 1e-3 from the first (no warm-up), which the tiny GPT's loss falls over and which moves most bf16
# weights by more than their rounding (at the schedule's warm-up LR of 3e-5..9e-5, 3 steps left most bf16 weights where
# they were, so a step that never wrote them trained "the same").
EQUIV = dict(preset="tiny", steps=6, warmup_steps=1, lr=1e-3, min_lr=1e-4, lr_warmup_steps=0)


def moments_of(engine) -> list[dict]:
    """Each sub-group's Adam state (step, exp_avg, exp_avg_sq), copied."""
    state = engine.optimizer.optimizer.state
    return [{k: state[master][k].detach().clone() for k in ("step", "exp_avg", "exp_avg_sq")}
            for _, master in lp_and_master(engine)]


def lp_and_master(engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sub-group's 16-bit partition (what the parameters are) and its fp32 master partition, on this rank."""
    zero_opt = engine.optimizer
    return [(lp, zero_opt.fp32_partitioned_groups_flat[i])
            for i, lp in enumerate(zero_opt.fp16_partitioned_groups_flat) if lp is not None]


def train_fused(train: TrainConfig, mode: str, rank: int, norm_check: str = "host", inf_at: int | None = None,
                fused: bool = True, bad: float = float("inf")) -> dict:
    """train.steps steps of the tiny GPT with torch's AdamW (fused unless told) under ZeRO-3 and `mode`'s step; the
    weights' checksum before training and after each step, the losses, the global norms and the fast step's counts;
    after each step, how the 16-bit partitions stand to the fp32 master weights (DeepSpeed's step copies the master
    into them). Tensors, which main compares and leaves out of the JSON: the Adam moments at the end ("moments"), the
    16-bit partitions before and after training ("weights"). inf_at: before that step's update, rank 0 sets one element
    of its reduced gradient partition to `bad` (inf or NaN); the moments after the step before and after that one are
    kept too ("moments_around_skip")."""
    engine = build_engine(train, lambda model: torch.optim.AdamW(
        param_groups(model, train.weight_decay), lr=train.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused))
    zero3_step.apply(engine, mode, norm_check)
    batches = iter(train_loader(train, rank, 0, pin_memory=False))
    losses, norms, checksums, lrs, lp_rounds_master, lp_within_ulp, lp_moved = [], [], [], [], [], [], []
    checksum0 = param_checksum(engine.module)
    lp0 = [lp.clone() for lp, _ in lp_and_master(engine)]
    around_skip = []
    for i in range(train.steps):
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        if i == inf_at and rank == 0:
            engine.optimizer.grad_partitions_flat_buffer[0] = bad
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
        checksums.append(param_checksum(engine.module))
        lrs.append(engine.get_lr()[0])
        pairs = lp_and_master(engine)
        # DeepSpeed's copy rounds the master to nearest; the AdamW kernel in Triton's interpreter truncates: < 1 ulp
        lp_rounds_master.append(all(torch.equal(lp, master.to(lp.dtype)) for lp, master in pairs))
        ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(pairs[0][0].dtype, 0.0)
        lp_within_ulp.append(all(bool(((lp.float() - master).abs() <= master.abs() * ulp).all())
                                 for lp, master in pairs))
        lp_moved.append(sum(int((lp != before).sum()) for (lp, _), before in zip(pairs, lp0, strict=True))
                        / sum(before.numel() for before in lp0))
        if inf_at is not None and i in (inf_at - 1, inf_at):
            around_skip.append(moments_of(engine))
    state = engine.optimizer.optimizer.state
    return {"checksum": param_checksum(engine.module), "checksum0": checksum0, "losses": losses, "norms": norms,
            "checksums": checksums, "lrs": lrs, "skipped_steps": engine.skipped_steps,
            "lp_rounds_master": lp_rounds_master, "lp_within_ulp": lp_within_ulp, "lp_moved": lp_moved,
            "calls": zero3_step.calls(engine), "grad_scale_left": hasattr(engine.optimizer.optimizer, "grad_scale"),
            "found_inf_left": hasattr(engine.optimizer.optimizer, "found_inf"),
            "state": sorted([sorted(st), float(st["step"]), str(st["step"].device), str(st["exp_avg"].dtype)]
                            for st in state.values()),
            "moments": moments_of(engine), "moments_around_skip": around_skip,
            "weights": [torch.cat([t.float() for t in lp0]),
                        torch.cat([lp.float() for lp, _ in lp_and_master(engine)])]}


def weights_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """How far run a's change of its 16-bit weights over training (after minus before, element by element) is from
    run b's: the norm of the difference of the two changes and the norm of b's change."""
    delta_a, delta_b = (a[1] - a[0]).double(), (b[1] - b[0]).double()
    return {"diff_norm": float((delta_a - delta_b).norm()), "delta_norm": float(delta_b.norm()),
            "same_start": bool(torch.equal(a[0], b[0]))}


def moments_gap(a: list[dict], b: list[dict]) -> list[dict]:
    """Per sub-group, how far run a's Adam moments are from run b's: both step counts, and for exp_avg and exp_avg_sq
    the largest absolute difference and b's largest magnitude (the test's tolerance is relative to it)."""
    gaps = []
    for sa, sb in zip(a, b, strict=True):
        gap = {"step": [float(sa["step"]), float(sb["step"])]}
        for k in ("exp_avg", "exp_avg_sq"):
            ta, tb = sa[k].double(), sb[k].double()
            gap[k] = {"max_diff": float((ta - tb).abs().max()), "max_abs": float(tb.abs().max()),
                      "finite": bool(ta.isfinite().all() and tb.isfinite().all())}
        gaps.append(gap)
    return gaps


def eager_persist(train: TrainConfig, rank: int) -> dict:
    """Two steps of the tiny GPT whose parameters are no longer persistent (what DeepCompile's set-up does to
    them: p.ds_persist = False), the first with eager ZeRO-3's persistent list, the second after
    drop_eager_persistent; how many parameters each step left gathered."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine = build_engine(train, lambda model: build_optimizer(model, train, torch.device("cpu")))
    listed = len(engine.optimizer.persistent_parameters)
    try:  # still persistent (no DeepCompile): refused, and the list is kept
        drop_eager_persistent(engine)
        refusal = None
    except RuntimeError as e:
        refusal = str(e)
    kept_after_refusal = len(engine.optimizer.persistent_parameters)
    for p in engine.module.parameters():
        p.ds_persist = False
    batches = iter(train_loader(train, rank, 0, pin_memory=False))
    gathered, losses = [], []
    for drop in (False, True):
        dropped = drop_eager_persistent(engine) if drop else None
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        gathered.append(sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters()))
    return {"listed": listed, "refusal": refusal, "kept_after_refusal": kept_after_refusal, "dropped": dropped,
            "left": len(engine.optimizer.persistent_parameters),
            "offload_left": len(engine.optimizer.parameter_offload.persistent_parameters),
            "gathered_after_step": gathered, "losses": losses}


def cached_walks(train: TrainConfig, rank: int) -> dict:
    """cache_deepcompile_walks on an engine set up as DeepCompile leaves it (persistence off, the list dropped, the
    eager-fallback context attached): when the optimizer step's release walks DeepSpeed's tree, and what the
    forward context releases and marks, against DeepSpeed's own fallback on the same states."""
    from deepspeed.compile.z3_eager_fallback import DeepCompileZ3EagerFallback
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine = build_engine(train, lambda model: build_optimizer(model, train, torch.device("cpu")))
    for p in engine.module.parameters():
        p.ds_persist = False
    drop_eager_persistent(engine)
    try:  # no fallback context (not DeepCompile): refused
        cache_deepcompile_walks(engine)
        refusal = None
    except RuntimeError as e:
        refusal = str(e)
    params = list(engine.module.parameters())
    walks = []
    deepspeeds_walk = engine.optimizer._partition_all_parameters
    engine.optimizer._partition_all_parameters = lambda: (walks.append(1), deepspeeds_walk())[1]
    deepspeeds = DeepCompileZ3EagerFallback(engine)
    engine._deepcompile_z3_eager_fallback = DeepCompileZ3EagerFallback(engine)
    cache_deepcompile_walks(engine)
    gathered = lambda: [p.ds_id for p in params if p.ds_status != ZeroParamStatus.NOT_AVAILABLE]
    engine.optimizer._partition_all_parameters()
    walks_when_partitioned = len(walks)
    params[0].all_gather()
    params[3].all_gather()
    gathered_before = gathered()
    engine.optimizer._partition_all_parameters()
    walk = {"walks": len(walks) - walks_when_partitioned, "gathered_after": gathered()}
    in_forward = lambda: sorted({m._parameters._in_forward for m in engine.module.modules()
                                 if isinstance(m._parameters, ZeROOrderedDict)})
    contexts = {}
    for name, fallback in (("deepspeed", deepspeeds), ("cached", engine._deepcompile_z3_eager_fallback)):
        params[1].all_gather()
        params[5].all_gather()
        with fallback.forward_context():
            inside = in_forward()
            released = sorted(fallback._last_pre_forward_released_param_ids)
        contexts[name] = {"released": released, "in_forward_inside": inside, "in_forward_after": in_forward(),
                          "gathered_after": gathered()}
    batches = iter(train_loader(train, rank, 0, pin_memory=False))
    x, y = next(batches)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return {"refusal": refusal, "recorded": deepcompile.CACHED_WALKS, "n_params": len(params),
            "n_modules": len(list(engine.module.modules())), "walks_when_partitioned": walks_when_partitioned,
            "gathered_before": gathered_before,
            "walk": walk, "contexts": contexts, "expected_released": sorted([params[1].ds_id, params[5].ds_id]),
            "loss": float(loss.detach()), "gathered_after_step": gathered()}


def main(out: str, data: str) -> None:
    ensure_env()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    train = TrainConfig(preset="tiny", steps=3, warmup_steps=1)
    engine = build_engine(train, lambda model: build_optimizer(model, train, torch.device("cpu")))
    zero_opt = engine.optimizer
    batches = iter(train_loader(train, rank, 0, pin_memory=False))
    x, y = next(batches)
    engine.backward(engine(x, y))

    groups = range(len(zero_opt.fp16_groups))
    grads = {i: list(zero_opt.averaged_gradients[i]) for i in groups}
    ds_norms = [float(zero_opt.get_grad_norm_direct(grads[i], zero_opt.fp16_groups[i])) for i in groups]
    ds_fp32 = []
    for i in groups:
        zero_opt._prepare_fp32_grad_for_sub_group(i)
        ds_fp32.append(zero_opt.fp32_partitioned_groups_flat[i].grad.clone())
        zero_opt.averaged_gradients[i] = grads[i]

    assert zero3_step.apply(engine, "fast") and not any(zero3_step.calls(engine).values())
    fast_norms = [float(zero_opt.get_grad_norm_direct(grads[i], zero_opt.fp16_groups[i])) for i in groups]
    same_fp32 = []
    for i in groups:
        zero_opt._prepare_fp32_grad_for_sub_group(i)
        fast = zero_opt.fp32_partitioned_groups_flat[i].grad
        same_fp32.append(fast.dtype == torch.float32 and torch.equal(fast, ds_fp32[i])
                         and fast.data_ptr() != zero_opt.grad_partitions_flat_buffer.data_ptr())
        zero_opt.averaged_gradients[i] = grads[i]
    calls_direct = zero3_step.calls(engine)

    # an infinite gradient: the fast norm gives DeepSpeed's -1 (its step then skips the update), filled on the device
    saved = grads[0][0].clone()
    grads[0][0].fill_(float("inf"))
    inf_norm = zero_opt.get_grad_norm_direct(grads[0], zero_opt.fp16_groups[0])
    grads[0][0].copy_(saved)

    # a gradient that is not a view of the flat buffer (a copy) makes both fall back to DeepSpeed's code
    moved = [g.clone() if j == 0 else g for j, g in enumerate(grads[0])]
    fallback_norm = float(zero_opt.get_grad_norm_direct(moved, zero_opt.fp16_groups[0]))
    calls_fallback = zero3_step.calls(engine)

    engine.step()  # DeepSpeed's step, with the fast norm and copy inside
    step_norm = float(engine.get_global_grad_norm())
    calls_step = zero3_step.calls(engine)
    x, y = next(batches)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    fused = {f"{mode}_clip{clip:g}": train_fused(TrainConfig(**EQUIV, data=data, grad_clip=clip), mode, rank)
             for clip in (0.0, 0.05) for mode in ("fast", "deepspeed", "fused")}
    # the kernel against torch's AdamW with no bf16 rounding between them (the interpreter truncates to bf16)
    fused.update({f"fp32_{mode}_clip{clip:g}": train_fused(
        TrainConfig(**EQUIV, data=data, grad_clip=clip, precision="fp32"), mode, rank)
        for clip in (0.0, 0.05) for mode in ("fast", "fused")})
    # the invalid-norm check on the device against DeepSpeed's on the host, an inf (and a NaN) gradient before step
    # 2's update: the AdamW kernel, torch's fused AdamW and a non-fused AdamW (no hook: the flag read on the host)
    clipped = TrainConfig(**EQUIV, data=data, grad_clip=1.0)
    norm_check = {f"{mode}_{check}": train_fused(clipped, mode, rank, check, inf_at=1)
                  for mode in ("fused", "fast") for check in ("host", "device")}
    norm_check.update({f"unfused_{check}": train_fused(clipped, "fast", rank, check, inf_at=1, fused=False)
                       for check in ("host", "device")})
    norm_check.update({f"nan_{mode}_{check}": train_fused(clipped, mode, rank, check, inf_at=1, bad=float("nan"))
                       for mode in ("fused", "fast") for check in ("host", "device")})
    norm_check["fused_device_finite"] = train_fused(clipped, "fused", rank, "device")
    norm_check["fused_host_finite"] = train_fused(clipped, "fused", rank, "host")
    # the Adam moments of each pair the tests compare, then the JSON without the tensors
    moments = {f"{p}{mode}_clip{clip}": moments_gap(fused[f"{p}{mode}_clip{clip}"]["moments"],
                                                    fused[f"{p}fast_clip{clip}"]["moments"])
               for p, modes in (("", ("fused", "deepspeed")), ("fp32_", ("fused",)))
               for mode in modes for clip in ("0", "0.05")}
    # a skipped update: after it, device and host alike, the moments of the step before (the schedules part later)
    for name in ("fused", "fast", "unfused", "nan_fused", "nan_fast"):
        for check in ("host", "device"):
            before, after = norm_check[f"{name}_{check}"]["moments_around_skip"]
            moments[f"norm_check_{name}_{check}_skip"] = moments_gap(after, before)
        device, host = norm_check[f"{name}_device"], norm_check[f"{name}_host"]
        moments[f"norm_check_{name}_device_vs_host"] = moments_gap(device["moments_around_skip"][1],
                                                                   host["moments_around_skip"][1])
    for name in ("fused_host", "fused_device", "fast_host", "fast_device"):
        moments[f"norm_check_nan_vs_inf_{name}"] = moments_gap(norm_check[f"nan_{name}"]["moments"],
                                                               norm_check[name]["moments"])
    weights = {f"{p}{mode}_clip{clip}": weights_gap(fused[f"{p}{mode}_clip{clip}"]["weights"],
                                                   fused[f"{p}fast_clip{clip}"]["weights"])
               for p, modes in (("", ("fused", "deepspeed")), ("fp32_", ("fused",)))
               for mode in modes for clip in ("0", "0.05")}
    moments["norm_check_finite"] = moments_gap(norm_check["fused_device_finite"]["moments"],
                                               norm_check["fused_host_finite"]["moments"])
    for r in (*fused.values(), *norm_check.values()):
        del r["moments"], r["moments_around_skip"], r["weights"]
    persist = eager_persist(train, rank)
    walks = cached_walks(train, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"fused": fused, "norm_check": norm_check, "moments": moments, "weights": weights,
                       "eager_persist": persist,
                       "cached_walks": walks,
                       "ds_norms": ds_norms, "fast_norms": fast_norms, "same_fp32": same_fp32,
                       "calls_direct": calls_direct, "inf_norm": float(inf_norm),
                       "fallback_norm": fallback_norm, "calls_fallback": calls_fallback,
                       "step_norm": step_norm, "calls_step": calls_step, "n_groups": len(groups),
                       "next_loss": float(loss.detach()), "world": dist.get_world_size()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0, torch.device("cpu"))  # DeepSpeed's engine can abort the CPU interpreter's teardown
