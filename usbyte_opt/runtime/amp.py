"""Mixed precision: what ``torch.amp.GradScaler`` needs from the runtime.

bf16 autocast needs nothing. ``GradScaler`` talks to optimizers that set
``_step_supports_amp_scaling`` (the :class:`DistributedOptimizer` does): ``scaler.step(opt)``
first reads ``opt.param_groups`` to look for non-finite gradients, then calls ``opt.step()``
with ``opt.grad_scale`` (the scale still to divide by, or ``None`` after ``scaler.unscale_``)
and ``opt.found_inf``. Reading ``param_groups`` between backward and ``step()`` completes the
step's communication first, so the scaler checks the *averaged* gradients. Those are the same
on every rank (an all-reduce gives every rank the same sums; one rank's ``inf`` is every
rank's ``inf`` or ``nan``), so every rank reaches the same verdict without a collective of its
own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def unscale(tensors: Sequence[torch.Tensor], grad_scale: torch.Tensor | None,
            device: torch.device) -> None:
    """Divide the gradient ``tensors`` (the flat buffers; under torch DDP, the parameters'
    ``p.grad``) by ``grad_scale`` in place, on their device, no host wait; nothing when the
    scaler has unscaled already (``None``)."""
    if grad_scale is None or not tensors:
        return
    inv = grad_scale.double().reciprocal().float().to(device)
    dummy = torch.zeros(1, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), dummy, inv)


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips its own update on the device when ``found_inf`` is set
    (PyTorch's fused optimizers): then a skipped step needs no host wait."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def skip_on_host(found_inf: torch.Tensor) -> bool:
    """The scaler's verdict, read on the host (a device sync on CUDA)."""
    return bool(found_inf.detach().reshape(-1)[0].item() > 0)
