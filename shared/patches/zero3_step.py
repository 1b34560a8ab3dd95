"""A faster ZeRO-3 optimizer step: the gradient partitions read as the one flat buffer they already are.

Installed through shared/patches (`patches.install(engine, train)`), which checks the DeepSpeed version first; the
registry there names each method replaced here. The measurements: docs/ledger.md (rows `--zero3_step fast`,
`--zero3_step fused`, `--grad_norm_check device`) and docs/results.md ("Where the ZeRO-3 optimizer step goes").

DeepSpeed 0.19.8's DeepSpeedZeroOptimizer_Stage3.step (deepspeed/runtime/zero/stage3.py), on a GPU, spends most of
its time in two per-parameter Python loops over the gradient partitions of each sub-group, although those
partitions are adjacent views of one buffer (`grad_partitions_flat_buffer`, laid out sub-group by sub-group):

- the gradient norm (`get_grad_norm_direct`): per parameter, a copy to fp64 and a norm, then a stack and a sum;
  launch-bound: most of its time is kernel launches, not kernels;
- the fp32 gradient of each sub-group (`_prepare_fp32_grad_for_sub_group`): a torch.cat of the views (a bf16 copy)
  and then the fp32 cast (a second copy);
- the unscale and clip (`unscale_and_clip_grads`): a multiply of the whole fp32 gradient by 1/scale, paid even when
  the scale is 1 (bf16, norm under the clip).

`install(zero_opt)` replaces the first two on the optimizer instance by one kernel each on the flat region of the
sub-group: `torch.linalg.vector_norm(region, dtype=float32)` (fp32 accumulation, as torch.nn.utils.clip_grad_norm_;
DeepSpeed accumulates the per-parameter squares in fp64: the two agree within the tolerance
tests/test_zero3_step.py asserts) and one `region.to(float32)`. Where the inner optimizer is torch's fused Adam/AdamW,
it hands the combined scale to the optimizer's own `grad_scale` (the hook torch.amp.GradScaler uses), so the fused
kernel divides each gradient by it as it reads it and the multiply pass disappears (exact for a scale of 1; with
clipping, a division instead of a multiply by the reciprocal). Everything else (the all-reduce of the squared norm
over the partition group, the -1 for an inf/NaN norm that DeepSpeed turns into a skipped step, the clip factor,
the update) stays DeepSpeed's. Each call checks that its gradients still are the adjacent views of the buffer in
order, and hands the call to DeepSpeed's own method when they are not (frozen parameters, CPU offload) or when the
norm is not the plain 2-norm of one data-parallel group (model or expert parallelism); the unscale does the same
for any other optimizer (DeepSpeed's FusedAdam, a non-fused AdamW on CPU) or a GradScaler. `calls(engine)` counts
each, and every result records them (extra.zero3_step_calls), so a run that fell back says so.

`fused` (`install(zero_opt, fused_adamw=True)`) is `fast` with the sub-group's update in one pass instead of three: the
fp32 gradient copy, torch's AdamW and DeepSpeed's copy of the fp32 parameters into the 16-bit partition become one
Triton kernel (shared/kernels/adamw.py) that reads the 16-bit gradient partition where it lies, divides it by the
combined scale, updates the fp32 parameters and moments and writes the 16-bit copy. The moments and the step count
stay in torch's AdamW state, laid out as torch keeps them, so checkpoints are the same as `fast`'s. It takes torch's
AdamW only (no amsgrad, no maximize, a float learning rate, the step count on the parameter's device as the fused
kernel keeps it); any other sub-group step runs `fast`'s with the optimizer's own step, counted apart
(`adamw_kernel`, `own_optimizer`).

The invalid-norm check on the device (`install(zero_opt, norm_check="device")`, `--grad_norm_check device`): DeepSpeed's
step asks the host whether the global gradient norm is inf/NaN (`is_invalid_grad_norm`, a `bool()` of a device
tensor: the host waits for the whole backward and the norm, and the device then idles while the host launches the
rest of the step and the next forward). Here that call returns False at once and leaves the flag on the device, and
each sub-group's update skips itself there when it is set: the AdamW kernel's `skip`, or torch's fused Adam/AdamW's
`found_inf` (the hook torch.amp.GradScaler skips a step with; the step count is taken back as well). An invalid norm
thus changes no parameter, moment or step count, as with DeepSpeed, and the global norm the engine reports is inf, so
the run stops at the next progress line as before (nan_policy stop). What differs: the host does not know of the
skip during the step, so the engine counts it as a step taken (its learning-rate schedule advances, as torch's with a
GradScaler does) and `calls(engine)["norm_skipped"]` counts the skips, read at the end. It applies to bf16 and fp32
(fp16's dynamic loss scale is updated on the host from its own overflow check: DeepSpeed's step runs there, counted
`norm_check_host`), each step counted `norm_check_device`; a sub-group whose update has neither hook (another
optimizer) reads the flag on the host, counted `norm_check_sync`.
"""

from __future__ import annotations

import torch

from shared.train.config import GRAD_NORM_CHECKS, ZERO3_STEPS

# The optimizer whose step is in progress with the check on the device, and the flag its norm check left there.
_DEFERRED: dict = {"opt": None, "invalid": None}


def _flat_region(buffer: torch.Tensor | None, grads) -> torch.Tensor | None:
    """The region of `buffer` that the tensors `grads` tile, in order and without gaps; None if they do not."""
    if buffer is None or not grads or grads[0] is None or buffer.dim() != 1 or buffer.stride(0) != 1:
        return None
    storage = buffer.untyped_storage().data_ptr()
    start = grads[0].storage_offset()
    offset = start
    for g in grads:
        if (g is None or g.dtype != buffer.dtype or g.dim() != 1 or g.stride(0) != 1
                or g.storage_offset() != offset or g.untyped_storage().data_ptr() != storage):
            return None
        offset += g.numel()
    # the same storage, but outside the buffer's own span: narrow() would count a negative start from the end
    if start < buffer.storage_offset() or offset > buffer.storage_offset() + buffer.numel():
        return None
    return buffer.narrow(0, start - buffer.storage_offset(), offset - start)


def _fast_norm_applies(zero_opt) -> bool:
    return (zero_opt.model_parallel_group is None and not zero_opt.offload_optimizer
            and not getattr(zero_opt, "use_muon", False))


def _stepped_directly(zero_opt) -> bool:
    """Whether DeepSpeed steps the inner optimizer itself, on the device: no offload, no GradScaler, no Muon, not
    ZenFlow."""
    return (not zero_opt.offload_optimizer and getattr(zero_opt, "torch_autocast_gradscaler", None) is None
            and not getattr(zero_opt, "zenflow", False) and not getattr(zero_opt, "use_muon", False))


def _folds_scale(zero_opt) -> bool:
    """Whether the sub-group's optimizer step can divide by the combined scale itself: torch's Adam/AdamW with the
    fused kernel (the only implementation that takes `grad_scale`), stepped by DeepSpeed directly."""
    inner = zero_opt.optimizer
    return (isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
            and all(group.get("fused") for group in inner.param_groups)
            and getattr(inner, "grad_scale", None) is None and getattr(inner, "found_inf", None) is None
            and _stepped_directly(zero_opt))


def _adamw_kernel_group(zero_opt, sub_group_id) -> dict | None:
    """The torch AdamW param group whose update the AdamW kernel can run for this sub-group, else None."""
    inner = zero_opt.optimizer
    if (type(inner) is not torch.optim.AdamW or not _stepped_directly(zero_opt)
            or zero_opt.fp16_partitioned_groups_flat[sub_group_id] is None):
        return None
    group = inner.param_groups[zero_opt.sub_group_to_group_id[sub_group_id]]
    if (group.get("amsgrad") or group.get("maximize") or group.get("differentiable")
            or isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"])):
        return None
    fp32_flat = zero_opt.fp32_partitioned_groups_flat[sub_group_id]
    lp_flat = zero_opt.fp16_partitioned_groups_flat[sub_group_id]
    if (fp32_flat.dtype != torch.float32 or fp32_flat.dim() != 1 or not fp32_flat.is_contiguous()
            or lp_flat.numel() != fp32_flat.numel() or not lp_flat.is_contiguous()):
        return None
    step = inner.state.get(fp32_flat, {}).get("step")
    if step is not None and (not isinstance(step, torch.Tensor) or step.device != fp32_flat.device):
        return None
    return group


def _patch_invalid_norm_check() -> None:
    """DeepSpeed's stage3 module's is_invalid_grad_norm, deferred for the optimizer in _DEFERRED (once per process)."""
    import deepspeed.runtime.zero.stage3 as stage3

    original = stage3.is_invalid_grad_norm
    if getattr(original, "_zero3bench", False):
        return

    def is_invalid_grad_norm(norm):
        if _DEFERRED["opt"] is None or not torch.is_tensor(norm):
            return original(norm)
        _DEFERRED["invalid"] = (~torch.isfinite(norm) | (norm < 0)).any()  # DeepSpeed's test, left on the device
        return False

    is_invalid_grad_norm._zero3bench = True
    is_invalid_grad_norm.__wrapped__ = original  # DeepSpeed's own, for the fingerprint (shared/patches/fingerprints.py)
    stage3.is_invalid_grad_norm = is_invalid_grad_norm


def _checks_on_device(zero_opt) -> bool:
    """Whether the step's invalid-norm check can stay on the device: no fp16 loss scale (updated on the host from the
    overflow), DeepSpeed stepping the inner optimizer itself, no Muon."""
    return zero_opt.dtype != torch.float16 and _stepped_directly(zero_opt)


def install(zero_opt, fused_adamw: bool = False, norm_check: str = "host") -> bool:
    """Give a DeepSpeedZeroOptimizer_Stage3 the flat-buffer gradient norm and fp32 gradient copy and the unscale inside
    a fused AdamW (with fused_adamw, the AdamW kernel instead of the copy, torch's AdamW and the 16-bit copy), and with
    norm_check="device" the invalid-norm check left on the device; returns whether it did (False for any other
    optimizer, e.g. ZeRO 1/2's, which is left as it is)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if norm_check not in GRAD_NORM_CHECKS:
        raise ValueError(f"unknown grad_norm_check {norm_check!r}; choose one of {GRAD_NORM_CHECKS}")

    if not isinstance(zero_opt, DeepSpeedZeroOptimizer_Stage3) or getattr(zero_opt, "_zero3bench_fast_step", False):
        return bool(getattr(zero_opt, "_zero3bench_fast_step", False))
    if fused_adamw:
        from shared.kernels.adamw import interpreted

        device = zero_opt.fp32_partitioned_groups_flat[0].device
        if device.type != "cuda" and not interpreted():
            raise ValueError("zero3_step 'fused' runs its AdamW kernel in Triton, on CUDA tensors; these are on "
                             f"{device}. Use 'fast' on a CPU (or set TRITON_INTERPRET=1 to run Triton's interpreter)")
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.utils import get_norm_dtype

    deepspeed_norm = zero_opt.get_grad_norm_direct
    deepspeed_prepare = zero_opt._prepare_fp32_grad_for_sub_group
    deepspeed_unscale = zero_opt.unscale_and_clip_grads
    deepspeed_optimizer_step = zero_opt._optimizer_step
    deepspeed_reassign = zero_opt._reassign_or_swap_out_partitioned_parameters
    deepspeed_step = zero_opt.step
    counts = {"fast": 0, "deepspeed": 0, "unscale_fused": 0, "unscale_deepspeed": 0}
    if fused_adamw:
        counts.update(adamw_kernel=0, own_optimizer=0)
    if norm_check == "device":
        counts.update(norm_check_device=0, norm_check_host=0, norm_check_sync=0)
    skipped = {}  # "count": the device tensor of updates skipped for an invalid norm (norm_check device)
    pending_scale = {}  # sub-group -> the combined scale its optimizer step divides by
    kernel_grads = {}  # sub-group -> (its 16-bit gradient region, its AdamW param group): the AdamW kernel's step
    lp_written = set()  # sub-groups whose 16-bit partition the kernel wrote

    def get_grad_norm_direct(gradients, params, norm_type=2):
        region = None
        if float(norm_type) == 2.0 and _fast_norm_applies(zero_opt):
            region = _flat_region(zero_opt.grad_partitions_flat_buffer, gradients)
        if region is None or zero_opt._autoep_expert_parallel_group(params) is not None:
            counts["deepspeed"] += 1
            return deepspeed_norm(gradients, params, norm_type)
        counts["fast"] += 1
        zero_opt._assert_same_partition_group(params)
        group = zero_opt._get_param_partition_group(params[0])
        squares = torch.linalg.vector_norm(region, 2.0, dtype=torch.float32).to(get_norm_dtype()).square()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
        total = squares.sqrt()
        invalid = total.isinf().logical_or(total.isnan())
        # full_like fills on the device: torch.tensor(-1.0, device=...) would copy from the host and sync the stream
        return torch.where(invalid, torch.full_like(total, -1.0, dtype=torch.float), total)

    def _prepare_fp32_grad_for_sub_group(sub_group_id):
        fp32_flat = zero_opt.fp32_partitioned_groups_flat[sub_group_id]
        region = _flat_region(zero_opt.grad_partitions_flat_buffer, zero_opt.averaged_gradients[sub_group_id])
        if region is None or region.numel() != fp32_flat.numel():
            counts["deepspeed"] += 1
            return deepspeed_prepare(sub_group_id)
        counts["fast"] += 1
        group = _adamw_kernel_group(zero_opt, sub_group_id) if fused_adamw else None
        if group is not None:  # the kernel reads the 16-bit region itself: no fp32 copy
            kernel_grads[sub_group_id] = (region, group)
        else:
            fp32_flat.grad = region.to(fp32_flat.dtype, copy=True)
        zero_opt.averaged_gradients[sub_group_id] = None

    def unscale_and_clip_grads(sub_group_id, total_norm):
        if sub_group_id not in kernel_grads and not _folds_scale(zero_opt):
            counts["unscale_deepspeed"] += 1
            return deepspeed_unscale(sub_group_id, total_norm)
        counts["unscale_fused"] += 1
        combined_scale = zero_opt.loss_scale  # DeepSpeed's formula, kept on the device (no host sync)
        if zero_opt.clip_grad > 0.0:
            clip = ((total_norm / zero_opt.loss_scale) + 1e-6) / zero_opt.clip_grad
            combined_scale = torch.clamp(clip, min=1.0) * zero_opt.loss_scale
        device = zero_opt.fp32_partitioned_groups_flat[sub_group_id].device
        pending_scale[sub_group_id] = (  # a Python scale (no clip) is filled on the device, not copied (a sync)
            combined_scale.to(device=device, dtype=torch.float32) if isinstance(combined_scale, torch.Tensor)
            else torch.full((), combined_scale, dtype=torch.float32, device=device))

    def _adamw_kernel_step(sub_group_id, grad, group, scale, invalid):
        from shared.kernels.adamw import adamw_step

        inner = zero_opt.optimizer
        fp32_flat = zero_opt.fp32_partitioned_groups_flat[sub_group_id]
        state = inner.state[fp32_flat]
        if not state:  # as torch's fused AdamW lays it out, so that checkpoints and a later torch step agree
            state["step"] = torch.zeros((), dtype=torch.float32, device=fp32_flat.device)
            state["exp_avg"] = torch.zeros_like(fp32_flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(fp32_flat, memory_format=torch.preserve_format)
        state["step"].add_(1 if invalid is None else invalid.logical_not().to(state["step"].dtype))
        beta1, beta2 = group["betas"]
        adamw_step(fp32_flat.data, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=group["lr"],
                   beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=scale,
                   param_lp=zero_opt.fp16_partitioned_groups_flat[sub_group_id], skip=invalid)
        inner._opt_called = True  # what torch's step wrapper records for the LR scheduler's order check
        lp_written.add(sub_group_id)

    def _optimizer_step(sub_group_id):
        scale = pending_scale.pop(sub_group_id, None)
        invalid = _DEFERRED["invalid"] if _DEFERRED["opt"] is zero_opt else None
        if sub_group_id in kernel_grads:
            grad, group = kernel_grads.pop(sub_group_id)
            counts["adamw_kernel"] += 1
            return _adamw_kernel_step(sub_group_id, grad, group, scale, invalid)
        if fused_adamw:
            counts["own_optimizer"] += 1
        if scale is None:
            if invalid is not None:  # no hook to skip the update on the device: the flag is read here
                counts["norm_check_sync"] += 1
                if bool(invalid):
                    return None
            return deepspeed_optimizer_step(sub_group_id)
        zero_opt.optimizer.grad_scale = scale
        if invalid is not None:  # torch's fused Adam/AdamW skips the update (and takes the step count back) when set
            zero_opt.optimizer.found_inf = invalid.to(torch.float32)
        try:
            return deepspeed_optimizer_step(sub_group_id)
        finally:
            del zero_opt.optimizer.grad_scale
            if invalid is not None:
                del zero_opt.optimizer.found_inf

    def _reassign_or_swap_out_partitioned_parameters(sub_group_id):
        if sub_group_id in lp_written:  # the kernel already wrote the 16-bit partition: only point the params at it
            lp_written.discard(sub_group_id)
            return zero_opt._unflatten_partitioned_parameters(sub_group_id)
        return deepspeed_reassign(sub_group_id)

    def step(closure=None):
        if not _checks_on_device(zero_opt):
            counts["norm_check_host"] += 1
            return deepspeed_step(closure)
        counts["norm_check_device"] += 1
        _DEFERRED.update(opt=zero_opt, invalid=None)
        try:
            deepspeed_step(closure)
            invalid = _DEFERRED["invalid"]
        finally:
            _DEFERRED.update(opt=None, invalid=None)
        if invalid is not None:  # one in-place add a step: no new tensor after the first
            if "count" not in skipped:
                skipped["count"] = torch.zeros((), dtype=torch.int64, device=invalid.device)
            skipped["count"].add_(invalid)

    if norm_check == "device":
        _patch_invalid_norm_check()
        zero_opt.step = step
        zero_opt._zero3bench_norm_skipped = skipped
    zero_opt.get_grad_norm_direct = get_grad_norm_direct
    zero_opt._prepare_fp32_grad_for_sub_group = _prepare_fp32_grad_for_sub_group
    zero_opt.unscale_and_clip_grads = unscale_and_clip_grads
    zero_opt._optimizer_step = _optimizer_step
    zero_opt._reassign_or_swap_out_partitioned_parameters = _reassign_or_swap_out_partitioned_parameters
    zero_opt._zero3bench_fast_step = True
    zero_opt._zero3bench_step_calls = counts
    return True


def calls(engine) -> dict[str, int] | None:
    """How many gradient norms and fp32 gradient copies ran the flat-buffer code (`fast`) and how many fell back to
    DeepSpeed's (`deepspeed`), and how many unscales went into the fused optimizer (`unscale_fused`) or ran
    DeepSpeed's multiply (`unscale_deepspeed`); with the norm check on the device, the steps that checked there
    (`norm_check_device`) or, fp16, on the host (`norm_check_host`), the flags read on the host for an update without
    a hook (`norm_check_sync`) and the updates skipped (`norm_skipped`); None when the fast step is not installed."""
    optimizer = getattr(engine, "optimizer", None)
    counts = getattr(optimizer, "_zero3bench_step_calls", None)
    if counts is None:
        return None
    counts = dict(counts)
    skipped = getattr(optimizer, "_zero3bench_norm_skipped", None)
    if skipped is not None:  # the updates the device skipped for an invalid norm (read here: one sync, at the end)
        counts["norm_skipped"] = int(skipped["count"]) if "count" in skipped else 0
    return counts


def apply(engine, mode: str, norm_check: str = "host") -> bool:
    """TrainConfig.zero3_step and grad_norm_check on a live engine: `fast` installs the step above on a ZeRO-3
    optimizer, `fused` the same with the AdamW kernel, norm_check "device" leaves the invalid-norm check on the device
    (`fast` or `fused` only); returns whether the engine now runs it."""
    if mode not in ZERO3_STEPS:
        raise ValueError(f"unknown zero3_step {mode!r}; choose one of {ZERO3_STEPS}")
    if norm_check not in GRAD_NORM_CHECKS:
        raise ValueError(f"unknown grad_norm_check {norm_check!r}; choose one of {GRAD_NORM_CHECKS}")
    if mode == "deepspeed" and norm_check != "host":
        raise ValueError("--grad_norm_check device runs inside this project's ZeRO-3 step: use --zero3_step fast or "
                         "fused, not deepspeed")
    return mode != "deepspeed" and install(engine.optimizer, fused_adamw=mode == "fused", norm_check=norm_check)
