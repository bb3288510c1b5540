"""The per-schedule state of a :class:`~usbyte_opt.runtime.DistributedOptimizer`.

Everything that depends on the schedule running (the flat buffers, the step's communication,
the pending updates, the forward gates, their hooks, the trace recorder) is one
:class:`Installed`, built by :func:`install` from the schedule, the model and the
:class:`Options`. The optimizer holds one; a plan switch (the tuner's) removes it
(:meth:`Installed.remove`) and installs a new one in its place, never a part of it. What lasts
across schedules (the wrapped optimizer and its state, the channel, the step count) stays
on the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import FormatError
from ..formats import Mode, Schedule
from .backward import StepComm
from .buffers import FlatGrads
from .checks import check_hierarchy, whole_world
from .comm import Channel
from .compiled import merged_pieces, plan_pieces
from .forward import ForwardGates, _Hook
from .guard import Guard
from .semantics import BufferSync, declared, steps_per_parameter
from .sharded import GatherBack, Sharded
from .updates import HostUpdates, StreamUpdates, SubsetStepper, Updates

if TYPE_CHECKING:
    from .trace import Recorder


@dataclass(frozen=True)
class Options:
    """The optimizer's options that every schedule is installed with.

    Attributes:
        passes: backward passes per ``step()``.
        find_unused: exchange the usage map each step.
        update_groups: optimizer calls per step of :class:`~.updates.StreamUpdates`.
        wait_in_backward: DDP's gradient contract (wait at the end of backward).
        buffer_sync: DDP's buffer rule run by the model's root forward (the Horovod-style
            optimizer), or None (the wrapper's forward runs it, or nothing is synced).
        trace_path: the Chrome trace to record (:mod:`.trace`), or None.
        align_bytes: where each tensor of the flat buffers starts (:class:`~.buffers.FlatGrads`).
        zero_stage: 2: sharded mode keeps no flat gradient buffer (ZeRO-2, :mod:`.sharded`).
        accept_compiled_rounding: a compiled model's graphs are split at the plan's pieces
            under any backend (:class:`.compiled.PlanSplit`).
    """

    passes: int
    find_unused: bool
    update_groups: int
    wait_in_backward: bool
    buffer_sync: BufferSync | None
    trace_path: str | None
    align_bytes: int = 0
    zero_stage: int = 1
    accept_compiled_rounding: bool = False


@dataclass(eq=False)
class Installed:
    """One schedule installed on the model: its state and the hooks that read it.

    Attributes:
        schedule: the schedule running.
        source: where it came from (a file name, ``<auto schedule>``, ...).
        grads: the flat gradient buffers.
        stepper: steps the wrapped optimizer on subsets of the tensors.
        in_opt: per tensor, whether the wrapped optimizer steps it.
        candidates: the tensors it steps, in runtime order.
        updates: the pending updates (overlap mode; in fence mode they are never started).
        comm: the communication state of the step in progress.
        gates: the forward-side hooks.
        handles: every hook handle :func:`install` registered (:meth:`remove` removes them).
        trace: the recorder of the measured timeline, or None.
        sharded: the shards of sharded mode (:mod:`.sharded`), or None.
        guard: DDP's contract for code that touches a tensor whose gradient or update is
            still in flight (:mod:`.guard`).
    """

    schedule: Schedule
    source: str
    grads: FlatGrads
    stepper: SubsetStepper
    in_opt: list[bool]
    candidates: list[int]
    updates: Updates
    comm: StepComm
    gates: ForwardGates
    handles: list[Any]
    trace: Recorder | None
    sharded: Sharded | None = None
    guard: Guard | None = None
    #: An overlap schedule whose optimizer is not per-parameter: it is stepped whole, once,
    #: after the step's last block, as under DDP (:mod:`.semantics`), so the step runs in
    #: fence mode.
    whole_step: bool = False
    #: Runtime indices in ``model.parameters()`` order (computed when first needed).
    model_order: list[int] | None = None

    @property
    def mode(self) -> Mode:
        """The mode the step runs in: the schedule's :class:`~usbyte_opt.formats.Mode`, or
        fence mode for an optimizer stepped whole (:attr:`whole_step`)."""
        return Mode.FENCE if self.whole_step else self.schedule.mode

    @property
    def n(self) -> int:
        """Trainable tensors."""
        return self.grads.n

    @property
    def m(self) -> int:
        """Blocks of the schedule."""
        return len(self.schedule.blocks)

    def remove(self) -> None:
        """Remove the hooks and give the parameters their own gradients back."""
        if self.guard is not None:
            self.guard.disarm_all()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.grads.detach()


def hier_issuer(schedule: Schedule, grads: FlatGrads, chan: Channel) -> Callable[[int, tuple], Any]:
    """Issues block ``k`` of a schedule with hierarchical blocks (:mod:`.hier`): those
    hierarchically on the groups of :meth:`~.comm.Channel.hier_channel` (made here, on every
    rank alike), the others as flat blocks."""
    chan.hier_channel(schedule.nodes)
    hier = [b.hier for b in schedule.blocks]
    views = grads.block_views

    def issue(k: int, streams: tuple) -> Any:
        if hier[k]:
            return chan.hier_all_reduce_block(views[k], streams)
        return chan.all_reduce_block(views[k], streams)
    return issue


def install(schedule: Schedule, source: str, model: torch.nn.Module, options: Options, *,
            optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
            chan: Channel, wrapper_check: Callable[..., None], settle: Callable[..., None],
            previous: Installed | None = None) -> Installed:
    """Build the state of ``schedule`` and install its hooks on ``model``.

    Args:
        schedule: the schedule (checked against the model already).
        source: where it came from.
        model: the module being trained.
        options: the optimizer's options.
        optimizer: the wrapped optimizer.
        params: the trainable parameters by name.
        chan: the channel of the collectives.
        wrapper_check: the model's forward pre-hook that refuses a DDP or FSDP wrapper.
        settle: the model's state-dict pre-hook (applies pending updates).
        previous: the state this one replaces (removed already): the optimizer calls so far
            and ``no_sync()`` in force carry over, and its trace is closed.
    """
    if schedule.hierarchical and previous is not None:
        # A plan switched to (the start-up checked the first one): refused on every rank
        # alike (sharded mode, nodes).
        check_hierarchy(schedule, chan.world_size, source, whole_world=whole_world(chan.group))
    device = chan.device
    zero_stage = options.zero_stage if schedule.mode == Mode.SHARDED else 1
    grads = FlatGrads(schedule, params, device, options.align_bytes, stored=zero_stage != 2)
    per_param = steps_per_parameter(optimizer)
    stepper = SubsetStepper(optimizer, grads, device,
                            previous.stepper.calls if previous is not None else 0,
                            per_parameter=per_param, declared=per_param and declared(optimizer))
    in_opt = [gi >= 0 for gi in stepper.group_of]
    pieces = plan_pieces(grads.block_tensors, grads.tensor_blocks)
    if schedule.cut_pieces and schedule.cut_pieces[-1] > max(pieces):
        # Every rank has the same schedule: every rank raises here alike.
        raise FormatError(source, f"cut_pieces[{len(schedule.cut_pieces) - 1}]",
                          f"a piece number below {max(pieces) + 1} (the plan's blocks make "
                          f"{max(pieces) + 1} pieces)", schedule.cut_pieces[-1])
    trace = _recorder(options.trace_path, schedule, grads, chan, previous)

    # The step's callbacks into the updates and the gates, which are built below.
    def flush_for_backward() -> list[int]:
        """The next backward starts: every pending update must be done first."""
        return updates.flush() if updates.n_pending else []

    comm = StepComm(schedule, grads, chan, options.passes, options.find_unused,
                    flush_for_backward, options.wait_in_backward)
    comm.no_sync = previous is not None and previous.comm.no_sync
    sharded: Sharded | None = None
    if schedule.mode == Mode.SHARDED:
        sharded = _sharded(schedule, grads, stepper, optimizer, chan, zero_stage, comm, trace)
    elif schedule.hierarchical:
        comm.issue_block = hier_issuer(schedule, grads, chan)
    comm.trace = trace
    comm.refresh()
    updates = _updates(schedule, grads, stepper, comm, chan, sharded, trace,
                       options.update_groups)
    gates = ForwardGates(model, grads.params, updates, chan, options.buffer_sync,
                         comm.clear_flushed, comm.output_grad,
                         lambda: not comm.no_sync and comm.passes + 1 >= comm.k,
                         merged_pieces(pieces, schedule.cut_pieces),
                         options.accept_compiled_rounding)

    def settle_param(ts: list[int]) -> None:
        """A tensor with a pending update was touched: run its update first."""
        updates.gate(ts)
        guard.disarm(ts)

    guard = Guard(grads.params, comm.complete, settle_param, grads.names)
    comm.guard = updates.guard = guard
    if sharded is not None:
        comm.keep_grad_guard = True
        guard.refuse_grads = sharded.refuse_grad_access
    handles = _hooks(model, grads, comm, gates, zero_stage == 2, wrapper_check, settle,
                     resplit=previous is None)
    if trace is not None:
        trace.install(model)   # after the gates: its forward start runs before theirs
    return Installed(schedule, source, grads, stepper, in_opt,
                     [t for t in range(grads.n) if in_opt[t]], updates, comm, gates, handles,
                     trace, sharded, guard,
                     whole_step=not per_param and schedule.mode == Mode.OVERLAP)


def _recorder(trace_path: str | None, schedule: Schedule, grads: FlatGrads, chan: Channel,
              previous: Installed | None) -> Recorder | None:
    """A trace file given (or ``$USBYTE_TRACE``): a recorder of the measured timeline,
    imported only then, so the runtime does not depend on it. The previous schedule's trace is
    closed, and whether recording is paused carries over (``record_trace()``)."""
    if not trace_path:
        return None
    from .trace import attach

    trace = attach(trace_path, schedule, grads, chan)
    if previous is not None and previous.trace is not None:
        previous.trace.close()
        trace.paused = previous.trace.paused  # record_trace() holds across a plan switch
    return trace


def _sharded(schedule: Schedule, grads: FlatGrads, stepper: SubsetStepper,
             optimizer: torch.optim.Optimizer, chan: Channel, zero_stage: int, comm: StepComm,
             trace: Recorder | None) -> Sharded:
    """Sharded mode's state, and the step's communication turned to it: reduce-scatters that
    let go of their buffers during backward, each gradient scaled as it is put in place."""
    sharded = Sharded(schedule, grads, stepper.group_of, optimizer, chan, zero_stage)
    comm.issue_block = sharded.reduce_scatter
    comm.collective = "reduce-scatter"
    sharded.trace = trace
    comm.reaping = True   # finished reduce-scatters let go of their buffers during backward
    sharded.reap = comm.reap
    # Each gradient scaled as it is put in place, as the shards' layout wants it.
    comm.block_scale, comm.put_scale = None, comm.scale
    if zero_stage == 2:
        comm.put = sharded.put
    return sharded


def _updates(schedule: Schedule, grads: FlatGrads, stepper: SubsetStepper, comm: StepComm,
             chan: Channel, sharded: Sharded | None, trace: Recorder | None,
             update_groups: int) -> HostUpdates | StreamUpdates:
    """How the pending updates run: in sharded mode the parameters' all-gathers; on NCCL in
    overlap mode queued on an update stream; else on the host at first use."""
    if sharded is not None:  # the pending updates are the parameters' all-gathers
        return HostUpdates(grads, GatherBack(sharded), chan.wait, sharded.what, trace,
                           sharded.order())
    if chan.device.type == "cuda" and schedule.mode == Mode.OVERLAP and chan.stream_waits:
        # NCCL: the update stream waits for each block's collective, the host never does.
        # (gloo carrying CUDA tensors waits on the host: its updates run at first use, below.)
        return StreamUpdates(grads, stepper, chan.wait, comm.what, chan.device, update_groups)
    return HostUpdates(grads, stepper, chan.wait, comm.what, trace)


def _hooks(model: torch.nn.Module, grads: FlatGrads, comm: StepComm, gates: ForwardGates,
           zero2: bool, wrapper_check: Callable[..., None], settle: Callable[..., None],
           resplit: bool = True) -> list[Any]:
    """The schedule's hooks: each gradient's, the forward gates, the model's wrapper check
    and its state-dict pre-hooks. ``resplit``: a compiled model's graphs are split again for
    this schedule's pieces (not on a switch of the tuner's: see :meth:`PlanSplit.register`)."""
    handles: list[Any] = [p.register_post_accumulate_grad_hook(comm.hook(t))
                          for t, p in enumerate(grads.params)]
    if zero2:  # p.grad's placeholder cannot be accumulated into: late gradients refused first
        handles += [p.register_hook(comm.pre_hook(t)) for t, p in enumerate(grads.params)]
    handles += gates.install(resplit)
    handles.append(model.register_forward_pre_hook(_Hook(wrapper_check)))
    # model.state_dict() / load_state_dict() see (and then replace) updated values. Local
    # only: a checkpoint may be written by rank 0 alone.
    handles.append(model.register_state_dict_pre_hook(_Hook(settle)))
    handles.append(model.register_load_state_dict_pre_hook(_Hook(settle)))
    return handles
