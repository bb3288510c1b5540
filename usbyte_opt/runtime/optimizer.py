"""``DistributedOptimizer``: a planned all-reduce schedule applied to data-parallel training.

The protocol is DESIGN.md §5. One iteration, seen from one rank:

1. Backward. Gradients accumulate into flat buffers (:mod:`.buffers`); the
   post-accumulate-grad hook of each tensor marks it ready, and every block whose tensors are
   all ready is all-reduced (async) as soon as it is also its turn in the schedule's issue
   order, so every rank issues the same collectives in the same order.
2. ``step()``. The iteration boundary: the blocks not issued yet go out (a tensor that got no
   gradient here contributes zeros), the optimizer's hyperparameters are recorded (an LR
   scheduler stepping right after ``step()`` must not change this iteration's update), and
   every tensor is marked *pending*. Nothing is updated yet.
3. Next forward. A forward pre-hook on each module that owns trainable tensors waits for the
   blocks of its pending tensors and steps the wrapped optimizer on exactly those tensors
   (plus any other pending tensor whose blocks have already finished, to save optimizer
   calls), so communication of the input-side tensors overlaps the forward of the next
   iteration. Pending tensors the forward never reached are updated when the next backward
   starts, or by ``synchronize()``.

Choices, with reasons:

* Subset steps. The wrapped optimizer is stepped on a subset by narrowing each param group's
  ``params`` list for the call and restoring it afterwards. Its state stays keyed by parameter
  (Adam's per-parameter ``step`` counts stay right), and outside the call ``param_groups`` is
  the user's, so ``state_dict()`` has the wrapped optimizer's format and LR schedulers act on
  the same group dicts. The hyperparameters in force at ``step()`` are put back into the groups
  for the call. The optimizer must update each parameter independently of the others (SGD,
  Adam, AdamW, RMSprop, Adagrad, ... do).
* Unused parameters. Each ``step()`` all-reduces a small usage count per tensor, issued after
  the last block (how many blocks went out during backward may differ between ranks when one
  did not use a tensor; what is issued after them never does); it is read only for tensors
  this rank gave no gradient. A tensor no
  rank gave a gradient is not updated (DDP with ``find_unused_parameters=True`` leaves its
  ``grad`` untouched, and after ``zero_grad()``'s default ``set_to_none`` the optimizer skips
  it), unless its gradient was zeroed with ``zero_grad(set_to_none=False)``, in which case it
  is stepped with that zero gradient, as under DDP. ``p.grad`` itself never becomes ``None``:
  it stays a view of the buffer.
* ``zero_grad()`` zeroes the buffer, never drops the views. A tensor with a pending update is
  zeroed right after its update (its buffer still holds the reduced gradient the update needs).
* Parameters used outside their module's forward (a parent module calling
  ``F.linear(x, self.child.weight)``): in the first iteration the runtime notes which tensors
  got a gradient without any owning module's pre-hook having run, and from then on updates
  them in the root module's pre-hook. A tensor later found used before its update raises.
* Buffers (BatchNorm statistics), as DDP's ``broadcast_buffers=True``: after every training
  forward with grad enabled, rank 0's buffers are broadcast (async, ordered before that
  iteration's gradient blocks) and installed at the start of the next forward or at
  ``synchronize()``. So every forward starts from rank 0's buffers, as with DDP; after
  ``synchronize()`` every rank holds rank 0's buffers.
* Forwards under ``torch.no_grad()`` / ``model.eval()`` apply every pending update when they
  start (inference code paths such as ``nn.TransformerEncoderLayer``'s fast path read weights
  without running the owning modules' forward): a forward after ``step()`` always sees updated
  parameters, with or without ``synchronize()``.
* Gradient accumulation: a tensor is ready after its ``backward_passes_per_step``-th gradient
  of the step (Horovod's rule); gradients are summed over the passes and averaged over ranks,
  as with DDP's ``no_sync()``.
* Mixed precision. bf16 autocast needs nothing. ``GradScaler``: this class sets
  ``_step_supports_amp_scaling``, so the scaler's non-finite check reads ``param_groups``;
  reading ``param_groups`` between backward and ``step()`` first finishes this iteration's
  communication, so the check (and ``scaler.unscale_``) sees the reduced gradients; ``step()``
  then agrees on the result across ranks (max all-reduce) before any update and skips the
  update when any gradient is non-finite. Those iterations run in fence mode (no overlap with
  the next forward).
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ..errors import DistributedError, UsbyteError
from ..formats import Schedule
from .buffers import FlatGrads
from .checks import (agree, broadcast_from_rank0, check_model, check_world_size,
                     resolve_schedule)
from .comm import Channel
from .default_plan import model_tensors, trainable_parameters

ScheduleArg = Schedule | str | os.PathLike | None

#: Optimizers whose channel is still open; :func:`_release_at_exit` closes them.
_OPEN: weakref.WeakSet[DistributedOptimizer] = weakref.WeakSet()


#: How long the exit hook waits for collectives still in flight (seconds).
EXIT_GRACE_S = 10.0


@atexit.register
def _release_at_exit(grace_s: float = EXIT_GRACE_S) -> None:
    """Finish and close, while the interpreter is still whole, the optimizers a script did not
    close. A gloo worker thread that drops the last reference to a tensor of a collective
    (a block, the usage map) needs the GIL; during interpreter finalization that thread is
    stopped instead and the process aborts ("terminate called without an active exception").
    So the hook waits up to ``grace_s`` for collectives still in flight (the other ranks are
    ending their scripts too), then closes the one-thread group, which joins its worker. An
    optimizer whose collectives do not finish in time, or failed, is left as it is: a rank
    whose peers are gone must not wait on the way out."""
    for opt in list(_OPEN):
        try:
            opt._release(grace_s)
        except Exception:  # noqa: BLE001 - exiting; the failure was or will be reported
            pass


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so that gradients are averaged over ranks in a planned order.

    Use it like Horovod's: wrap, then train as usual. The model is the plain module (no DDP
    wrapper); its parameters are broadcast from rank 0 here.

    Args:
        optimizer: the optimizer to wrap (it keeps the parameter state).
        model: the module being trained; its trainable parameters must match the schedule.
        schedule: a :class:`~usbyte_opt.formats.Schedule` or the path of a schedule file;
            default: the file named by ``$USBYTE_SCHEDULE``, else a DDP-like default plan
            (with a warning).
        process_group: the data-parallel group (default: the whole world).
        backward_passes_per_step: backward passes per ``step()`` (gradient accumulation);
            communication starts in the last one.
        broadcast_buffers: broadcast rank 0's module buffers after each training forward (as
            DDP's ``broadcast_buffers``).
        find_unused_parameters: exchange per-tensor usage each step so that tensors no rank
            gave a gradient are not updated. ``False`` saves that one small all-reduce per step;
            use it only when every rank produces every gradient every step.
        timeout: host-side limit of each wait on gloo (seconds or ``timedelta``); default: the
            process group's timeout. NCCL relies on its watchdog.
        one_in_flight: run the blocks' all-reduces one at a time, in schedule order, as the
            plan assumes. Default (``None``): on gloo, whose process group otherwise runs two
            collectives at once (blocks then go through a one-thread gloo group over the same
            ranks, see :mod:`usbyte_opt.runtime.comm`); NCCL serialises on its stream anyway.
            ``False`` issues blocks on ``process_group`` itself.

    Raises:
        MismatchError: the model does not match the schedule (names the first tensor).
        DistributedError: ranks disagree (different schedules), or a peer failed its checks.
        FormatError: the schedule file is missing or malformed.

    Example::

        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> from usbyte_opt.runtime import default_schedule
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model,
        ...                            schedule=default_schedule(model))
        >>> for _ in range(3):
        ...     loss = model(torch.randn(16, 4)).pow(2).mean()
        ...     loss.backward(); opt.step(); opt.zero_grad()
        >>> opt.synchronize()          # before eval, checkpoints and at the end
        >>> opt.state_dict()["state"][0]["step"]
        tensor(3.)
        >>> dist.destroy_process_group()
    """

    # GradScaler: set grad_scale / found_inf on us and call step() (see class notes).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 schedule: ScheduleArg = None, process_group: dist.ProcessGroup | None = None,
                 backward_passes_per_step: int = 1, *, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = True, timeout: float | timedelta | None = None,
                 one_in_flight: bool | None = None):
        # No super().__init__(): param_groups, state and defaults stay the wrapped optimizer's.
        self._opt = optimizer
        self._model = model
        if not dist.is_available() or not dist.is_initialized():
            raise UsbyteError("torch.distributed is not initialized: call "
                              "torch.distributed.init_process_group() first (or start the script "
                              "with `usbyte-opt launch`)")
        if isinstance(optimizer, DistributedOptimizer):
            raise UsbyteError("the optimizer is already a DistributedOptimizer: wrap the plain one")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise UsbyteError(f"backward_passes_per_step: expected an integer >= 1, got "
                              f"{backward_passes_per_step!r}")
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=float(timeout))
        self._group = process_group
        rank, ws = dist.get_rank(process_group), dist.get_world_size(process_group)
        params = trainable_parameters(model)
        device = params[0][1].device if params else torch.device("cpu")

        # 1. Local checks; an error is held back and shared (step 2) so that no rank hangs.
        error: BaseException | None = None
        sched: Schedule | None = None
        source = "<schedule>"
        try:
            if not params:
                raise UsbyteError(f"model {type(model).__name__}: no parameter requires grad")
            devices = {p.device for _, p in params}
            if len(devices) > 1:
                raise UsbyteError(f"trainable parameters live on {len(devices)} devices "
                                  f"({', '.join(sorted(map(str, devices)))}); expected one "
                                  "device per rank")
            sched, source = resolve_schedule(schedule, model, ws, warn=rank == 0)
            check_model(sched, model_tensors(model), source)
            self._check_optimizer(params)
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
            error = e
        # 2. Every rank the same schedule, before any other collective.
        agree(process_group, None if sched is None else sched.digest(), error, device, timeout)
        assert sched is not None
        check_world_size(sched, ws, rank)
        self.schedule = sched
        self.schedule_source = source
        # 3. Same starting point everywhere: parameters (frozen ones too) and buffers.
        broadcast_from_rank0([p.detach() for p in model.parameters()], process_group, timeout)
        if broadcast_buffers:
            broadcast_from_rank0(list(model.buffers()), process_group, timeout, "buffers")

        self._k = backward_passes_per_step
        self._chan = Channel(process_group, device, timeout, one_in_flight)
        had_grad = {n: p.grad is not None for n, p in params}
        self._grads = g = FlatGrads(sched, dict(params), device)
        n, m = g.n, len(sched.blocks)
        self._n, self._m = n, m
        self._find_unused = find_unused_parameters
        # Optimizer membership: group index and position in it, per tensor (-1: not stepped).
        where = {id(p): (gi, j) for gi, grp in enumerate(optimizer.param_groups)
                 for j, p in enumerate(grp["params"])}
        self._group_of = [where.get(id(p), (-1, 0))[0] for p in g.params]
        self._pos_in_group = [where.get(id(p), (-1, 0))[1] for p in g.params]
        self._rem0 = [len(ts) for ts in g.block_tensors]
        self._nblocks0 = [len(ks) for ks in g.tensor_blocks]

        # Per-iteration state (current backward) -----------------------------------------
        self._zeros = [0] * n
        self._count = [0] * n           # gradients received this step
        self._rem = self._rem0.copy()   # tensors of each block not ready yet
        self._next = 0                  # next block to issue
        self._works: list[dist.Work | None] = [None] * m
        self._streams: list[Any] = [None] * n
        self._bw_started = False        # a gradient arrived since the last step()
        self._comm_issued = False       # every block of this step issued (step/synchronize)
        self._comm_waited = False       # ... and waited for
        self._usage: torch.Tensor | None = None
        self._usage_work: dist.Work | None = None
        self._has_grad = [had_grad[nm] for nm in g.names]  # grad not None (see zero_grad)
        # Pending updates (previous step) --------------------------------------------------
        self._pending = [False] * n
        self._pending_n = 0
        self._zero_after = [False] * n
        self._include = [False] * n     # has a gradient for the optimizer (see _included)
        self._global_used: list[int] | None = None
        self._complete = [True] * m     # block waited for
        self._t_incomplete = [0] * n    # blocks of t not waited for yet
        self._ready_list: list[int] = []
        self._done_ptr = m
        self._hp: list[dict[str, Any]] = []
        self._flushed: list[int] = []   # tensors updated when backward began (stale check)
        self._flushed_flag = [False] * n
        # Learning which tensors are used outside their module's forward (first iteration).
        self._learning = True
        self._seen = [False] * n
        self._root_extra: list[int] = []
        self._root_owned: list[int] = []
        self._root_owned_set: set[int] = set()
        self._steps = 0
        # Buffers broadcast after training forwards.
        self._buffers = [b for b in model.buffers()] if broadcast_buffers and ws > 1 else []
        self._buf_pending: list[tuple[dist.Work, list[torch.Tensor], torch.Tensor]] = []

        self._handles: list[Any] = []
        self._install_hooks()
        self._closed = False
        _OPEN.add(self)
        # $USBYTE_TRACE set: a Recorder of the measured timeline (.trace), else None. Imported
        # only then, so the runtime does not depend on it.
        self._trace = None
        if os.environ.get("USBYTE_TRACE"):
            from .trace import attach

            self._trace = attach(self, model)

    # ------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------

    def _check_optimizer(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        model_ids = {id(p) for p in self._model.parameters()}
        for gi, grp in enumerate(self._opt.param_groups):
            for j, p in enumerate(grp["params"]):
                if id(p) not in model_ids:
                    raise UsbyteError(f"optimizer param_groups[{gi}]['params'][{j}] (shape "
                                      f"{list(p.shape)}) is not a parameter of the model: the "
                                      "runtime only averages and updates the model's parameters")

    def _install_hooks(self) -> None:
        g = self._grads
        for t, p in enumerate(g.params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(t)))
        owned: dict[int, list[int]] = {}
        mods: dict[int, torch.nn.Module] = {}
        index = {id(p): t for t, p in enumerate(g.params)}
        for mod in self._model.modules():
            ts = [index[id(p)] for p in mod._parameters.values()
                  if p is not None and id(p) in index]
            if ts:
                owned[id(mod)] = ts
                mods[id(mod)] = mod
        self._root_owned = owned.pop(id(self._model), [])
        self._root_owned_set = set(self._root_owned)
        for key, ts in owned.items():
            self._handles.append(mods[key].register_forward_pre_hook(_Hook(self._module_hook(ts))))
        self._handles.append(self._model.register_forward_pre_hook(_Hook(self._root_pre_hook),
                                                                   prepend=True))
        self._handles.append(self._model.register_forward_hook(_Hook(self._root_post_hook)))
        # model.state_dict() / load_state_dict() see (and then replace) updated values. Local
        # only: a checkpoint may be written by rank 0 alone.
        self._handles.append(self._model.register_state_dict_pre_hook(_Hook(self._settle_hook)))
        self._handles.append(self._model.register_load_state_dict_pre_hook(
            _Hook(self._settle_hook)))

    # ------------------------------------------------------------------------------------
    # Optimizer interface
    # ------------------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's groups. Read between backward and ``step()`` (GradScaler,
        gradient inspection), it first completes this step's all-reduce, so the gradients
        seen are the averaged ones."""
        if self._bw_started and not self._comm_waited:
            self._finish_comm(wait=True)
        return self._opt.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._opt.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._opt.defaults

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._opt

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self._opt).__name__}, schedule={self.schedule_source}"
                f" [{self.schedule.strategy}, {self._m} blocks], world_size="
                f"{self._chan.world_size})")

    def __getattr__(self, name: str) -> Any:
        # Anything else (register_step_pre_hook, ...) is the wrapped optimizer's.
        if name.startswith("__") or "_opt" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_opt"], name)

    def __getstate__(self) -> dict[str, Any]:
        raise UsbyteError("DistributedOptimizer cannot be pickled: save state_dict() instead")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """End the iteration: issue the remaining all-reduces and schedule the updates.

        The updates run lazily, tensor by tensor, in the next forward (or in
        :meth:`synchronize`). With a ``closure``, it is called first (with grad enabled) and
        its value returned.

        Returns:
            The closure's value, or ``None``.
        """
        if self._closed:
            raise UsbyteError("step() on a closed DistributedOptimizer: create a new one to "
                              "train on")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._trace is not None:
            self._trace.step()
        self._finish_comm(wait=False)
        skip = False
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:  # called by GradScaler.step(self)
            skip = self._amp_check(found_inf, getattr(self, "grad_scale", None))
        # Hyperparameters in force now (an LR scheduler stepped after us must not apply).
        self._hp = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in grp.items()
                     if k != "params"} for grp in self._opt.param_groups]
        n = self._n
        has = self._has_grad
        if not skip:
            for t in range(n):
                self._pending[t] = True
                self._include[t] = self._group_of[t] >= 0 and has[t]
                self._t_incomplete[t] = self._nblocks0[t]
                self._zero_after[t] = False
            self._pending_n = n
            self._complete = [False] * self._m
            self._done_ptr = 0
            self._ready_list = []
        else:
            self._wait_all_blocks()
        # Reset the backward state for the next step.
        self._count[:] = self._zeros   # in place: the hooks hold these lists
        self._rem[:] = self._rem0
        self._next = 0
        self._bw_started = False
        self._comm_issued = False
        self._comm_waited = False
        self._learning = False
        self._steps += 1
        self._opt._opt_called = True  # type: ignore[attr-defined]  # LR scheduler's check
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; they stay views of the flat buffers (never ``None``).

        ``set_to_none=True`` (the default) additionally records that the tensors have no
        gradient, so a tensor that then gets none on any rank is not updated (as the
        optimizer skips ``grad is None`` under DDP); with ``False`` a tensor that had a
        gradient keeps a zero one and is stepped with it. Tensors with a pending update are
        zeroed right after it.
        """
        if self._bw_started and not self._comm_waited:
            self._finish_comm(wait=True)  # do not zero a buffer that is being all-reduced
        g = self._grads
        if not self._pending_n:
            with torch.no_grad():
                for f in g.flats:
                    f.zero_()
        else:
            now = []
            for t in range(self._n):
                if self._pending[t]:
                    self._zero_after[t] = True
                else:
                    now.append(g.views[t])
            if now:
                torch._foreach_zero_(now)
        if set_to_none:  # set_to_none=False keeps "no gradient" where there was none, as torch
            self._has_grad[:] = [False] * self._n

    def synchronize(self) -> None:
        """Finish all communication and updates: call before eval, checkpoints, the end.

        Called after ``backward()`` but before ``step()``, it completes this step's
        all-reduce instead, so the averaged gradients can be read or changed (for example
        clipped) before ``step()``. Local only once the collectives are issued: ``step()``
        (or the first such call) issues them on every rank.
        """
        if self._bw_started and not self._comm_waited:
            self._finish_comm(wait=True)
        self._settle()
        if self._usage_work is not None and self._global_used is None:
            self._read_usage()  # nothing of this step left in flight

    def _settle_hook(self, *args: Any, **kwargs: Any) -> None:
        self._settle()

    def _settle(self) -> None:
        """Apply pending updates and install broadcast buffers: waits only, no new collective."""
        if self._pending_n:
            self._flush_pending()
        self._wait_buffers()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, in its own format (pending updates applied
        first; local, so rank 0 alone may call it)."""
        self._settle()
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of the wrapped optimizer (pending updates are applied first)."""
        self._settle()
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UsbyteError("add_param_group after wrapping is not supported: add the group to the "
                          "optimizer, then create the DistributedOptimizer")

    def close(self) -> None:
        """Synchronize, remove the hooks, give parameters their own gradients back and release
        the communication channel (on gloo, its one-thread group and worker thread). The
        optimizer cannot train after this; at interpreter exit, an optimizer not closed is
        released the same way (its collectives given a few seconds to finish)."""
        self.synchronize()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._grads.detach()
        self._release()

    def _release(self, grace_s: float | None = None) -> None:
        """Wait for every collective of this optimizer, drop the works and close the channel.
        With ``grace_s``, give up (and change nothing) if they have not all finished by then."""
        works = [w for w in self._works if w is not None] + [w for w, *_ in self._buf_pending]
        if self._usage_work is not None:
            works.append(self._usage_work)
        if grace_s is not None:
            deadline = time.monotonic() + grace_s
            while not all(w.is_completed() for w in works):
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.002)
        for w in works:  # NCCL: completed on the host is not yet done on the stream
            self._chan.wait(w, "a collective in flight at close()")
        self._works = [None] * self._m
        self._buf_pending = []
        self._usage_work = None
        self._chan.close()
        self._closed = True
        _OPEN.discard(self)

    # ------------------------------------------------------------------------------------
    # Backward: hooks and issue order
    # ------------------------------------------------------------------------------------

    def _grad_hook(self, t: int) -> Callable[[torch.Tensor], None]:
        # Runs once per tensor per backward: the lists are bound once, here.
        count, has_grad, flushed = self._count, self._has_grad, self._flushed_flag
        view, k, name = self._grads.views[t], self._k, self._grads.names[t]

        def hook(p: torch.Tensor) -> None:
            if not self._bw_started:
                self._begin_backward()
            if self._comm_issued:
                raise UsbyteError(f"parameter {name!r} got a gradient after this step's "
                                  "all-reduce was issued (by synchronize() or by reading "
                                  "param_groups); call step() before the next backward()")
            if flushed[t]:
                raise UsbyteError(f"parameter {name!r} was used in forward before its pending "
                                  "update was applied (it was used outside the forward of the "
                                  "modules that own it); call opt.synchronize() before such a "
                                  "forward")
            c = count[t] + 1
            count[t] = c
            if p.grad is not view:
                self._grads.relink(t)
            has_grad[t] = True
            if self._learning and not self._seen[t] and t not in self._root_owned_set:
                self._seen[t] = True
                self._root_extra.append(t)
            if self._chan.cuda:
                self._streams[t] = torch.cuda.current_stream(self._chan.device)
            if c == k:
                self._mark_ready(t)
            elif c > k:
                raise UsbyteError(f"parameter {name!r} got gradient {c} of "
                                  f"backward_passes_per_step={k} in one step, after its "
                                  "all-reduce started; pass the number of backward() calls per "
                                  "step() as backward_passes_per_step")
        return hook

    def _begin_backward(self) -> None:
        """First gradient of a step: the previous step's updates must all be done before any
        gradient of this one lands in the buffers or any block of this one is issued."""
        if self._pending_n:
            for t in self._flush_pending():
                self._flushed_flag[t] = True
                self._flushed.append(t)
        self._bw_started = True

    def _mark_ready(self, t: int) -> None:
        rem = self._rem
        for k in self._grads.tensor_blocks[t]:
            rem[k] -= 1
        nxt, m = self._next, self._m
        while nxt < m and rem[nxt] == 0:
            self._issue(nxt)
            nxt += 1
        self._next = nxt

    def _issue(self, k: int) -> None:
        streams: tuple = ()
        if self._chan.cuda:
            streams = tuple({s for s in (self._streams[t] for t in self._grads.block_tensors[k])
                             if s is not None})
        self._works[k] = self._chan.all_reduce_block(self._grads.block_views[k], streams)
        if self._trace is not None:
            self._trace.issue(k, self._works[k])

    def _finish_comm(self, wait: bool) -> None:
        """Issue what is left of this step (usage map, then the remaining blocks in order);
        with ``wait``, also wait for every block of it."""
        if not self._comm_issued:
            if self._pending_n:
                self._begin_backward()
            self._bw_started = True
            g = self._grads
            stale = [g.views[t] for t in range(self._n) if not self._count[t] and self._has_grad[t]]
            if stale:  # a tensor with no gradient this step contributes zeros
                torch._foreach_zero_(stale)
            while self._next < self._m:
                self._issue(self._next)
                self._next += 1
            # After the blocks: ranks may differ in how many blocks went out during backward
            # (a tensor one rank did not use), never in what follows them.
            if self._find_unused:
                used = torch.tensor([1 if c else 0 for c in self._count], dtype=torch.int32)
                self._usage = used.to(self._chan.comm_device)
                self._usage_work = self._chan.all_reduce(self._usage)
                self._global_used = None
            self._comm_issued = True
        if wait and not self._comm_waited:
            for k in range(self._m):
                w = self._works[k]
                if w is not None:
                    self._chan.wait(w, self._what(k))
            self._comm_waited = True

    def _what(self, k: int) -> str:
        b = self.schedule.blocks[k]
        return f"all-reduce of block {k} (buffer {b.buffer} [{b.start}, {b.end}))"

    # ------------------------------------------------------------------------------------
    # Updates: forward pre-hooks, flush
    # ------------------------------------------------------------------------------------

    def _module_hook(self, ts: list[int]) -> Callable[..., None]:
        pending = self._pending

        def hook(module: torch.nn.Module, args: Any) -> None:
            if self._pending_n:
                need = [t for t in ts if pending[t]]
                if need:
                    self._update_now(need)
            elif self._learning:
                for t in ts:
                    self._seen[t] = True
        return hook

    def _root_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self._buf_pending:
            self._wait_buffers()
        if self._flushed:
            for t in self._flushed:
                self._flushed_flag[t] = False
            self._flushed.clear()
        if self._pending_n:
            if not (module.training and torch.is_grad_enabled()):
                # Inference code paths may read weights without running their modules'
                # forward (nn.TransformerEncoderLayer's fast path does), and nothing is gained
                # by overlapping them: apply every pending update now.
                self._flush_pending()
                return
            need = [t for t in self._root_owned if self._pending[t]]
            need += [t for t in self._root_extra if self._pending[t]]
            if need:
                self._update_now(need)
        elif self._learning:
            for t in self._root_owned:
                self._seen[t] = True

    def _root_post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._buffers and module.training and torch.is_grad_enabled():
            self._wait_buffers()
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for b in self._buffers:
                by_dtype.setdefault(b.dtype, []).append(b)
            for bufs in by_dtype.values():
                flat = torch.cat([b.detach().reshape(-1) for b in bufs])
                self._buf_pending.append((self._chan.broadcast(flat), bufs, flat))

    def _wait_buffers(self) -> None:
        pend, self._buf_pending = self._buf_pending, []
        for work, bufs, flat in pend:
            self._chan.wait(work, "broadcast of module buffers from rank 0")
            if self._chan.rank != 0:
                off = 0
                with torch.no_grad():
                    for b in bufs:
                        b.copy_(flat[off: off + b.numel()].view_as(b))
                        off += b.numel()

    def _complete_block(self, k: int) -> None:
        w = self._works[k]
        if w is not None:
            self._chan.wait(w, self._what(k))
        self._complete[k] = True
        inc = self._t_incomplete
        for t in self._grads.block_tensors[k]:
            inc[t] -= 1
            if inc[t] == 0 and self._pending[t]:
                self._ready_list.append(t)

    def _update_now(self, need: Iterable[int]) -> None:
        """Wait for the blocks of ``need``, then update them together with every other pending
        tensor whose blocks have finished already (one optimizer call instead of several)."""
        tr = self._trace
        t0 = tr.now() if tr is not None else 0.0
        for t in need:
            for k in self._grads.tensor_blocks[t]:
                if not self._complete[k]:
                    self._complete_block(k)
        works, m = self._works, self._m
        while self._done_ptr < m:
            k = self._done_ptr
            if not self._complete[k]:
                w = works[k]
                if w is not None and not w.is_completed():
                    break
                self._complete_block(k)
            self._done_ptr += 1
        ready, self._ready_list = self._ready_list, []
        t1 = tr.now() if tr is not None else 0.0
        self._apply([t for t in ready if self._pending[t]])
        if tr is not None:
            tr.gate(need, t0, t1)

    def _flush_pending(self) -> list[int]:
        """Apply every pending update (waits for all blocks of the previous step); returns
        the tensors stepped."""
        for k in range(self._m):
            if not self._complete[k]:
                self._complete_block(k)
        self._done_ptr = self._m
        self._ready_list = []
        return self._apply([t for t in range(self._n) if self._pending[t]])

    def _wait_all_blocks(self) -> None:
        for k in range(self._m):
            w = self._works[k]
            if w is not None:
                self._chan.wait(w, self._what(k))
        self._complete = [True] * self._m

    def _included(self, t: int) -> bool:
        """Whether tensor ``t`` is stepped: it is in the optimizer and has a gradient here, or
        some rank gave it one (the usage map, read only for tensors this rank did not use)."""
        if self._include[t]:
            return True
        if self._group_of[t] < 0:
            return False
        if not self._find_unused:
            return True
        if self._global_used is None:
            self._read_usage()
        assert self._global_used is not None
        return self._global_used[t] > 0

    def _read_usage(self) -> None:
        """Wait for this step's usage map and keep it (``_global_used``)."""
        assert self._usage is not None and self._usage_work is not None
        self._chan.wait(self._usage_work, "all-reduce of the parameter usage map")
        self._global_used = self._usage.tolist()

    def _apply(self, ts: list[int]) -> list[int]:
        """Update the pending tensors ``ts`` (their blocks are complete); returns those stepped."""
        if not ts:
            return []
        g = self._grads
        stepped: list[int] = []
        subsets: dict[int, list[tuple[int, torch.nn.Parameter]]] = {}
        zero: list[torch.Tensor] = []
        for t in ts:
            self._pending[t] = False
            g.relink(t)
            if self._included(t):
                stepped.append(t)
                subsets.setdefault(self._group_of[t], []).append((self._pos_in_group[t], g.params[t]))
            if self._zero_after[t]:
                self._zero_after[t] = False
                zero.append(g.views[t])
        self._pending_n -= len(ts)
        if subsets:
            self._step_subset({gi: [p for _, p in sorted(ps, key=lambda x: x[0])]
                               for gi, ps in subsets.items()})
        if zero:
            torch._foreach_zero_(zero)
        return stepped

    def _step_subset(self, subsets: dict[int, list[torch.nn.Parameter]]) -> None:
        """``optimizer.step()`` on exactly ``subsets`` (group index -> params), with the
        hyperparameters recorded at ``step()``; ``param_groups`` is restored afterwards."""
        groups = self._opt.param_groups
        saved = [grp["params"] for grp in groups]
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for gi, grp in enumerate(groups):
                grp["params"] = subsets.get(gi, [])
                for key, val in self._hp[gi].items():
                    cur = grp.get(key)
                    if cur is not val:
                        swapped.append((grp, key, cur))
                        grp[key] = val
            with torch.inference_mode(False), _no_autocast(self._chan.device):
                self._opt.step()
        finally:
            for grp, params in zip(groups, saved):
                grp["params"] = params
            for grp, key, cur in reversed(swapped):
                grp[key] = cur

    # ------------------------------------------------------------------------------------
    # Mixed precision
    # ------------------------------------------------------------------------------------

    def _amp_check(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> bool:
        """GradScaler path: agree on non-finite gradients across ranks before any update;
        unscale if the scaler has not. Returns whether to skip this step's update."""
        self._finish_comm(wait=True)
        agreed = found_inf.detach().to(self._chan.comm_device, torch.float32).reshape(1).clone()
        self._chan.wait(self._chan.all_reduce(agreed, dist.ReduceOp.MAX),
                        "all-reduce of the GradScaler non-finite flag")
        if agreed.item() > 0:
            return True
        if grad_scale is not None:
            inv = grad_scale.double().reciprocal().float().to(self._chan.device)
            dummy = torch.zeros(1, device=self._chan.device)
            for flat in self._grads.flats:
                torch._amp_foreach_non_finite_check_and_unscale_([flat], dummy, inv)
        return False


class _Detached:
    """A hook that does nothing: what copies and pickles of the model carry instead of ours."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Hook:
    """A module hook of the runtime. ``copy.deepcopy(model)`` and ``torch.save(model)`` give
    a model without the runtime (a :class:`_Detached` hook), not a second optimizer."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _Detached:
        return _Detached()

    def __reduce__(self) -> tuple:
        return (_Detached, ())


class _no_autocast:
    """Disable autocast for the optimizer step if it is on (the update runs in full precision)."""

    __slots__ = ("dev", "ctx")

    def __init__(self, device: torch.device):
        self.dev = device.type
        self.ctx = None

    def __enter__(self) -> None:
        if torch.is_autocast_enabled(self.dev):
            self.ctx = torch.autocast(self.dev, enabled=False)
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
