"""How a model is profiled: every knob of :func:`usbyte_opt.profiler.profile_model`, in one
object that ``usbyte-opt profile``, ``usbyte-opt bench`` and its job file share (this module
imports no torch).

Example::

    >>> opts = ProfileOptions(repeats=2, comm_points=3, stable_s=0.0)
    >>> opts.warmup, opts.sweep_sizes()
    (3, [4096, 524288, 67108864])
    >>> ProfileOptions(comm_sizes=(4096, 8192)).sweep_sizes()
    [4096, 8192]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Time cap (seconds) of the extra rounds the sweep and the probe run until their numbers
#: are stable.
STABLE_S = 20.0

#: The pydantic configuration of the option objects read from files: no coercion (JSON mode
#: still reads an array as a tuple and an integer as a float), no unknown field, no NaN.
STRICT: dict[str, Any] = {"strict": True, "extra": "forbid", "allow_inf_nan": False}


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileOptions:
    """What to measure and how long: iterations, the optimizer, the all-reduce sweep (and
    those of reduce-scatter and all-gather), the probe of what all-reduce costs the training
    thread, the analytic fallback."""

    #: How pydantic validates these options inside a bench job file (:mod:`usbyte_opt.bench.job`).
    __pydantic_config__ = STRICT

    warmup: int = 3
    """Untimed iterations after the discovery pass."""
    repeats: int = 10
    """Timed iterations (medians are taken over them)."""
    optimizer: str = "sgd"
    """``sgd`` (momentum), ``adam`` or ``adamw``: whose step gives ``update_ms`` (unless the
    model's factory gives its own optimizer and ``factory_optimizer`` is on)."""
    factory_optimizer: bool = True
    """Time the step of the optimizer the model's factory gives, when it gives one
    (:func:`usbyte_opt.models.build_with_optimizer`), instead of ``optimizer``'s."""
    comm_sizes: tuple[int, ...] | None = None
    """All-reduce sizes of the sweep in bytes; ``None``: ``comm_points`` log-spaced sizes from
    4 KiB to 64 MiB."""
    comm_points: int = 12
    """Sizes of the sweep when ``comm_sizes`` is not given."""
    comm_repeats: int = 5
    """Timed all-reduces per size."""
    alpha_ms: float | None = None
    """World size 1: the analytic latency (ignored when measured)."""
    algbw_gbs: float | None = None
    """World size 1: the analytic bandwidth in GB/s (ignored when measured)."""
    shard_sweep: bool = True
    """With more than one rank, also sweep reduce-scatter and all-gather (the collectives of
    sharded data parallel) on the same channel: ``comm.reduce_scatter``, ``comm.all_gather``."""
    cpu_probe: bool = True
    """With more than one rank, also measure what all-reduce costs the training thread
    (:mod:`usbyte_opt.profiler.probe`)."""
    probe_points: int = 5
    """Sizes of that probe (chains of blocks up to the whole gradient)."""
    probe_repeats: int = 4
    """Passes of that probe before it adds passes until stable."""
    stable_s: float = STABLE_S
    """Time cap (seconds) of the extra rounds that the sweep and the probe each add until their
    numbers are stable (0: none)."""
    host_probe: bool = True
    """Also measure what the runtime and torch DDP cost the host per tensor and per block, and
    on CUDA whether the iteration is launch-bound (:mod:`usbyte_opt.profiler.host`; about a
    second): the profile's ``host`` section. Off: no section (the planner's defaults)."""

    compile: str | None = None
    """Time the model compiled with ``torch.compile(model, backend=compile)`` (``inductor``,
    ``aot_eager``, ...), as the run will train it, its graphs split at every tensor's first use
    as the runtime splits them at the plan's blocks (:mod:`usbyte_opt.runtime.compiled`), so
    that ``ready_ms`` are the compiled backward's; ``None``: eager."""
    cut_probes: int = 12
    """With :attr:`compile`: how many candidate cuts to time one by one (each a copy of the
    model compiled with that one cut, beside a copy compiled whole), the cuts the planner
    weighs (:mod:`usbyte_opt.planning.compiled`): ``meta.compile.cuts``. Where a model has
    more candidates (cuts between modules, in forward order), evenly spaced ones; the others
    cost their median. 0: none measured (the planner then takes cuts as free)."""
    cut_probe_s: float = 120.0
    """Time cap (seconds) of those probes: none starts after it (the first always runs); the
    places not timed cost the median of those that were, and a warning says how many ran."""

    def sweep_sizes(self) -> list[int]:
        """The all-reduce sizes the sweep times, in bytes."""
        from ..collectives.sweep import default_sizes

        return list(self.comm_sizes) if self.comm_sizes else default_sizes(points=self.comm_points)


__all__ = ["STABLE_S", "STRICT", "ProfileOptions"]
