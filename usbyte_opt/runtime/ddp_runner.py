"""A schedule whose runner is torch's DDP (``"runner": "ddp"``), in the wrapper.

``usbyte-opt optimize`` writes such a schedule when its plan is one DDP can express (fence
mode, one dtype, whole tensors, blocks in gradient-ready order) and DDP's lower host cost makes
it the fastest (docs/planner.md, *Runners*). :class:`usbyte_opt.DistributedDataParallel` then
runs no usbyte-opt runtime at all: torch's own ``DistributedDataParallel`` trains, built with
the user's arguments and the schedule's ``bucket_cap_mb_list``
(:func:`usbyte_opt.ddp.planned_ddp_kwargs`), so the run is DDP's, bitwise and at DDP's host
cost; only the bucket sizes are the plan's.

With verification on (the default) the planned buckets are timed against DDP with its
default buckets (the user's ``bucket_cap_mb``), two torch DDPs over the same module taking
turns in windows, by the same rule as the runtime's verification
(:class:`~usbyte_opt.runtime.autotune.Tuner`, :mod:`usbyte_opt.verdict`): the planned buckets
are kept only when measurably faster; otherwise the default ones train from then on. An
iteration is the interval between two steps of the optimizer over the model (a global
optimizer step hook, removed once settled). Both DDPs sum the same gradients; with two ranks
bitwise, as any change of DDP's buckets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..formats import Schedule
from .autotune import IterationStamps, Tuner
from .comm import Channel
from .default_plan import fallback_schedule
from .exit_hook import OPEN

#: What the planned buckets are timed against, in what users read.
DEFAULT_BUCKETS = "DDP's default buckets"


class DDPRunner:
    """Torch DDP with a schedule's planned buckets, and its verification.

    Args:
        module: the model.
        schedule: a schedule whose runner is DDP (checked against the model already).
        source: where it came from (messages).
        build: ``build(extra_kwargs)`` builds torch's DDP over the module with the user's
            arguments and ``extra_kwargs`` on top.
        find_unused_parameters, static_graph: the user's (the planned caps' order depends on
            them, :func:`usbyte_opt.ddp.planned_ddp_kwargs`).
        group: the data-parallel group.
        verify: time the planned buckets against DDP's default ones.
        bucket_cap_mb: the user's (DDP's default buckets; a model compiled under the planned
            DDP is compiled as under those, :func:`usbyte_opt.ddp.compiled_as_default`).
    """

    def __init__(self, module: torch.nn.Module, schedule: Schedule, source: str,
                 build: Any, find_unused_parameters: bool, static_graph: bool,
                 group: dist.ProcessGroup | None, verify: bool,
                 bucket_cap_mb: float | None = None):
        from ..ddp import planned_ddp_kwargs, watch_buckets

        self.plan, self.source = schedule, source
        self.planned = build(planned_ddp_kwargs(schedule, module, source=source,
                                                find_unused_parameters=find_unused_parameters,
                                                static_graph=static_graph))
        watch_buckets(self.planned, schedule, bucket_cap_mb)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        params = [p for p in module.parameters() if p.requires_grad]
        self.device = params[0].device if params else torch.device("cpu")
        self._n = len(params)
        self.default: Any = None
        self.fallback: Schedule | None = None
        self.chan: Channel | None = None
        self.active = self.planned
        self.tuner: Tuner | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        if verify and self.world_size > 1:
            self.default = build({})
            self.fallback = fallback_schedule(module, self.world_size)
            self.chan = Channel(group, self.device, None, serial=False)
            self.tuner = Tuner(self, self.fallback, auto=False, verify=True, auto_dir=None,
                               check_every=0)
            self.tuner.against = DEFAULT_BUCKETS
            OPEN.add(self)   # its gloo group released at exit if the run ends while verifying

    # -- what the wrapper asks ---------------------------------------------------------------

    @property
    def verifying(self) -> bool:
        """Whether the two DDPs still take turns."""
        return self.tuner is not None and self.tuner.phase != "settled"

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer over the model stepped: the first one seen times the iterations."""
        if self.optimizer is None:
            self.optimizer = optimizer
        if optimizer is self.optimizer and self.tuner is not None:
            self.tuner.after_step()
            if not self.verifying:
                self._settled()

    def _settled(self) -> None:
        """Verification is over: the side not kept goes (its buckets' memory with it)."""
        if self.active is self.planned:
            self.default = None
        else:
            self.planned = None
        self._release()

    def _release(self, grace_s: float | None = None) -> None:
        """Close the control group (nothing of it is in flight between steps); also at exit
        (:mod:`.exit_hook`)."""
        if self.chan is not None:
            self.chan.close()
            self.chan = None
        OPEN.discard(self)

    def report(self) -> dict[str, Any]:
        """What runs and what verification measured (the tuner's figures)."""
        base: dict[str, Any] = self.tuner.report() if self.tuner is not None else {}
        base.update(runner="ddp", running="plan" if self.active is self.planned else "default",
                    schedule={"source": self.source, "strategy": self.plan.strategy,
                              "buckets": len(self.plan.blocks)})
        return base

    # -- the tuner's view (:class:`~usbyte_opt.runtime.autotune.Tunable`) --------------------

    @property
    def schedule(self) -> Schedule:
        """The schedule running: the plan, or DDP's default buckets (the fallback)."""
        if self.active is self.planned or self.fallback is None:
            return self.plan
        return self.fallback

    @property
    def compiled(self) -> bool:
        """(Only ``auto`` asks; torch DDP's runner never plans.)"""
        return False

    def settled(self) -> None:
        """(Torch's DDP runs either way: nothing to hand back.)"""

    def switch(self, schedule: Schedule, source: str, measure: bool = False) -> None:
        self.active = self.planned if schedule is self.plan else self.default

    @property
    def tensor_count(self) -> int:
        return self._n

    @property
    def schedule_source(self) -> str:
        return self.source if self.active is self.planned else "<DDP's default buckets>"

    def control_all_reduce(self, t: torch.Tensor,
                           op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work | None:
        assert self.chan is not None
        return self.chan.control_all_reduce(t, op)

    def wait_host(self, work: dist.Work, what: str) -> None:
        assert self.chan is not None
        self.chan.wait_host(work, what)

    @property
    def grad_itemsize(self) -> int:
        return 4   # (planning in the run only: never asked here)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return []   # (planning in the run only)

    def control_broadcast(self, t: torch.Tensor) -> dist.Work | None:
        assert self.chan is not None
        return self.chan.control_broadcast(t)

    def all_reduce(self, t: torch.Tensor) -> dist.Work:
        raise NotImplementedError("a DDP-runner schedule plans nothing in the run")

    def set_probe(self, probe: IterationStamps | None) -> None:
        pass   # no probe: nothing is planned in the run

    def hold_communication(self, hold: bool) -> None:
        pass

    def synchronize(self) -> None:
        pass   # DDP has finished everything when step() returns

