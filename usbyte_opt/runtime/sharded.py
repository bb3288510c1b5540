"""Sharded mode (``Mode.SHARDED``): ZeRO-1 on the schedule's blocks, ZeRO-2 as an option
(docs/runtime.md).

**Shard layout.** Every block of the schedule is sharded on its own: block ``k`` covers the
element range ``[lo, hi)`` of its flat buffer (:class:`~.buffers.FlatGrads`, alignment padding
included), of length ``L``; with ``S = ceil(L / world_size)``, rank ``r`` owns
``[lo + r*S, min(lo + (r+1)*S, hi))``. The flat buffers keep their layout; a block whose length
is not a multiple of the world size goes through a staging tensor of ``world_size * S``
elements (the block, then zeros) for the reduce-scatter in, and so does every all-gather out
but that of a single block without padding (below).

**Optimizer state.** The wrapped optimizer (the user's object) is rebuilt over *shard
parameters*: one flat 1-D parameter per (block, tensor) piece this rank owns, a view of this
rank's parameter shard of the block (``pshard[k]``, ``S`` elements), whose gradient is the
matching view of the block's reduce-scatter output. Each piece lies in the param group of its
tensor, so the user's hyperparameters (and an LR scheduler acting on them) apply unchanged, and
the state the optimizer creates is only that of this rank's shards. A piece never mixes
tensors, so the update rule of the step (which tensors are stepped) stays per tensor. Only
elementwise optimizers qualify: ``SGD``, ``Adam``, ``AdamW`` (their ``foreach`` and ``fused``
variants included); their per-element state keys are :data:`ELEMENTWISE`.

**Collectives.** Backward: each block is reduce-scattered (its gradients pre-divided by the
world size, as for the all-reduce) as soon as it is its turn and its gradients are final
(:class:`~.backward.StepComm` issues through :meth:`Sharded.reduce_scatter`). ``step()``:
wait for them, copy the owned pieces of the parameters into the shards (so a parameter changed
outside the optimizer, by ``model.load_state_dict`` say, is what gets stepped), step the
optimizer on the shards, and issue the all-gathers of the parameter shards (the gradients in
the flat buffer are dead by then): one per group of the schedule's
:meth:`~usbyte_opt.formats.Schedule.gather_groups`, in that order (by default one per block,
in reverse block order, about the order the forward needs them). The parameter shards of a
group's blocks are consecutive views of one tensor, the group's input (``sum S_k`` elements,
in group order); its output is ``world_size`` times that, rank-major, in a staging tensor,
from which each block's part (the ``(world_size, S_k)`` slice, its first ``L_k`` elements) is
copied into the flat buffer when a tensor of the block is first needed. A group of one block
without padding is gathered straight into its flat view. A padded block's reduce-scatter
input is its own disjoint range of its group's staging output (free again by then: every
gathered value is copied out before the next backward). The copy of a tensor's gathered
values into its parameter is its pending update (:class:`GatherBack`, run by
:class:`~.updates.HostUpdates`): the forward pre-hook of the tensor's module waits only for
the works of the groups holding its blocks (the blocks of a group share one work), as overlap
mode does for its updates, so the all-gathers of later tensors overlap the forward; the next
backward, an eval forward, ``synchronize()`` and the state-dict hooks apply what is left.

**Clipping and GradScaler.** :meth:`Sharded.clip` computes the global gradient norm from one
all-reduce of the shards' per-tensor parts and scales the shards. A ``GradScaler`` reading
``param_groups`` after the step's last backward sees the shards (:meth:`Sharded.expose`):
each shard parameter's ``.grad`` is its gradient shard (so ``scaler.unscale_()`` unscales the
shards in place), and a sentinel parameter carries the all-reduced (MAX) non-finite flag of
every rank's shards, so the scaler's ``found_inf`` (its skip and its scale update) is the
same on every rank. ``step()`` then unscales the shards (unless the scaler did) and, on a
non-finite step, steps nothing and gathers nothing: the parameters stay as they are.

**ZeRO-2** (``zero_stage=2``; :class:`~.buffers.FlatGrads` built with ``stored=False``): no
flat buffer, its tensors layout only. Block ``k``'s gradient storage (``world_size * S``
elements, zeros: the reduce-scatter's input, padding included) is allocated when the first of
its tensors' gradients arrives in the step's last pass (:meth:`Sharded.put`, laid out as the
tensor's view would be, so the sums are ZeRO-1's), and let go when the block is issued: the
work holds it while it runs, and ``StepComm.reap`` drops the works of the finished
reduce-scatters (at each issue, each new block's storage, and ``step()``'s wait). ``p.grad``
becomes the placeholder of :class:`~.buffers.FlatGrads` (stride 0), so ``p.grad = None``
after backward is still seen. The all-gathers go into staging outputs allocated at each
``gather()``; a tensor's values are copied from there into the parameter at its gate
(:meth:`Sharded.content`), and a block's gathered values, then its group's output, go once
every tensor they hold is copied.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.issuers import all_gather_issuer, reduce_scatter_issuer
from ..errors import DistributedError, UsbyteError
from ..formats import Schedule
from .buffers import FlatGrads, dense_strides
from .comm import Channel
from .updates import inner_step

#: The optimizers sharded mode steps: elementwise updates, whose state it can shard.
SHARDABLE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.Adam,
                                                      torch.optim.AdamW)
#: Their per-element state (shaped like the parameter); every other key is one value per tensor.
ELEMENTWISE = frozenset({"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
#: Seconds ``state_dict()`` waits for every rank to call it too (at most; less with a shorter
#: ``timeout`` of the optimizer) before it raises instead of waiting out the process group.
STATE_DICT_WAIT_S = 300.0


def check_sharded(optimizer: torch.optim.Optimizer, schedule: Schedule, *,
                  wait_in_backward: bool) -> None:
    """Refuse, in one line, what sharded mode does not support (at construction)."""
    check_gathers(schedule)
    if type(optimizer) not in SHARDABLE:
        raise UsbyteError(f"sharded mode: {type(optimizer).__name__} is not supported: it steps "
                          "a shard of each tensor, which needs an elementwise optimizer "
                          "(SGD, Adam or AdamW)")
    if wait_in_backward:
        raise UsbyteError("sharded mode: wait_in_backward=True is not supported: the averaged "
                          "gradients exist only as shards, never whole in p.grad")


def check_gathers(schedule: Schedule) -> None:
    """The schedule's all-gather groups (:meth:`~usbyte_opt.formats.Schedule.gather_groups`)
    name every block exactly once, and each group's blocks share a dtype (a group is one
    all-gather of their shards, concatenated). A schedule file is checked when it is read;
    this also covers a :class:`~usbyte_opt.formats.Schedule` built in code."""
    m = len(schedule.blocks)
    seen: dict[int, int] = {}
    for i, grp in enumerate(schedule.gather_groups()):
        if not grp:
            raise UsbyteError(f"sharded mode: gathers[{i}] is empty: each all-gather names at "
                              "least one block")
        dtypes = set()
        for k in grp:
            if not 0 <= k < m:
                raise UsbyteError(f"sharded mode: gathers[{i}] names block {k}, but the "
                                  f"schedule has {m} blocks")
            if k in seen:
                raise UsbyteError(f"sharded mode: block {k} is in gathers[{seen[k]}] and "
                                  f"gathers[{i}]: each block in exactly one all-gather")
            seen[k] = i
            dtypes.add(schedule.buffers[schedule.blocks[k].buffer].dtype)
        if len(dtypes) > 1:
            raise UsbyteError(f"sharded mode: gathers[{i}] mixes blocks of dtypes "
                              f"{', '.join(sorted(dtypes))}: one all-gather concatenates its "
                              "blocks' shards, which needs one dtype")
    if len(seen) != m:
        k = min(set(range(m)) - set(seen))
        raise UsbyteError(f"sharded mode: block {k} is in no all-gather of the schedule's "
                          "gathers: each block in exactly one")


def _like(p: torch.Tensor, flat: torch.Tensor, start: int) -> torch.Tensor:
    """The view of ``flat`` at ``start`` with ``p``'s shape and layout, as FlatGrads builds."""
    if dense_strides(p.shape, p.stride()):
        return flat.as_strided(p.shape, p.stride(), flat.storage_offset() + start)
    return flat[start:start + p.numel()].view(p.shape)


def _flat_of(p: torch.Tensor) -> torch.Tensor:
    """``p``'s elements in the order of its view in the flat buffer (memory order when
    dense), as a 1-D tensor (an alias when dense, else a copy)."""
    d = p.detach()
    if dense_strides(d.shape, d.stride()):
        return d.as_strided((d.numel(),), (1,), d.storage_offset())
    return d.reshape(-1)


def _by_dtype(ts: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in ts:
        out.setdefault(t.dtype, []).append(t)
    return list(out.values())


class GatherBack:
    """The :class:`~.updates.HostUpdates` stepper of sharded mode: a tensor's pending update
    is the copy of its gathered values into the parameter, run by the forward gate of the
    tensor's module once its blocks' all-gathers have finished."""

    __slots__ = ("sharded",)

    def __init__(self, sharded: Sharded):
        self.sharded = sharded

    def step(self, ts: Sequence[int]) -> None:
        self.sharded.copy_back(ts)


_BOOK_IDS = itertools.count()


class CallBook:
    """The collective state-dict calls of sharded mode (``opt.state_dict()``, ``close()``),
    met through the default group's store, so that a call on some ranks only
    (``if rank == 0: save(opt.state_dict())``) fails in one line on every rank instead of
    leaving the others in their next collective until a watchdog.

    Each call records this rank's count of calls and what it called under keys of its own,
    then waits (polling the store) for every rank's arrival, at most :data:`STATE_DICT_WAIT_S`
    or the optimizer's shorter ``timeout``. Past that it leaves a note and raises. The other
    ranks went on into their next step, where a host wait of the runtime blocks: the channel
    asks :meth:`cause` (``Channel.cause``) every :data:`~.comm.CAUSE_POLL_S` seconds while
    blocked, and raises the note (naming the rank that called alone) as soon as it is there.
    Ranks that call different ones (``state_dict()`` here, ``close()`` there) all raise alike.
    Built on every rank in the same order (one per :class:`Sharded`)."""

    def __init__(self, chan: Channel):
        self.chan, self.rank, self.ws = chan, chan.rank, chan.world_size
        self.n = 0
        self.store: Any = None
        self.prefix = ""
        if self.ws > 1:
            from torch.distributed import distributed_c10d as c10d

            name = "default" if chan.group is None else c10d._get_process_group_name(chan.group)
            self.prefix = f"usbyte-state/{name}/{next(_BOOK_IDS)}"
            self.store = c10d._get_default_store()

    def limit(self) -> float:
        host = self.chan.host_timeout
        return STATE_DICT_WAIT_S if host is None else min(STATE_DICT_WAIT_S, host.total_seconds())

    def _get(self, key: str) -> str | None:
        k = f"{self.prefix}/{key}"
        return self.store.get(k).decode() if self.store.check([k]) else None

    def meet(self, what: str) -> None:
        """Wait for every rank to make this call too (see the class); raise if one does not."""
        if self.store is None:
            return
        self.n += 1
        n, st, p = self.n, self.store, self.prefix
        st.set(f"{p}/what/{n}/{self.rank}", what)
        st.set(f"{p}/n/{self.rank}", str(n))
        limit = self.limit()
        deadline = time.monotonic() + limit
        arrived = st.add(f"{p}/arrived/{n}", 1)
        while arrived < self.ws:
            note = self._get(f"refused/{n}")
            if note is not None:
                raise DistributedError(f"rank {self.rank}: {what} failed: {note}")
            if time.monotonic() >= deadline:
                self._refuse(what, n, limit)
            time.sleep(0.005)
            arrived = st.add(f"{p}/arrived/{n}", 0)
        whats = [self._get(f"what/{n}/{q}") for q in range(self.ws)]
        if len(set(whats)) > 1:
            raise DistributedError(
                f"rank {self.rank}: the ranks made different collective calls of sharded mode: "
                + ", ".join(f"rank {q} {w}" for q, w in enumerate(whats))
                + "; call the same on every rank")

    def _refuse(self, what: str, n: int, limit: float) -> None:
        late = [q for q in range(self.ws) if int(self._get(f"n/{q}") or 0) < n]
        ranks = f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))}"
        why = (f"in sharded mode it is a collective (it gathers every rank's shards): call it on "
               f"every rank and save on rank 0; {ranks} did not call it within {limit:g} s")
        self.store.set(f"{self.prefix}/refused/{n}", f"rank {self.rank} called {what} alone: {why}")
        raise DistributedError(f"rank {self.rank}: {what} called on this rank alone: {why}")

    def cause(self) -> str | None:
        """Why a wait cannot end, if a rank made a collective state-dict call the others did
        not: its note once it refused, or this rank's own refused call; else None."""
        if self.store is None:
            return None
        try:
            mine = self._get(f"refused/{self.n}") if self.n else None
            if mine is not None:
                return mine
            for q in range(self.ws):
                if q != self.rank:
                    c = int(self._get(f"n/{q}") or 0)
                    note = self._get(f"refused/{c}") if c > self.n else None
                    if note is not None:
                        return note
        except (RuntimeError, ValueError):
            return None
        return None


class Sharded:
    """The sharded state of one installed schedule.

    Args:
        schedule: the schedule (its blocks' buffers).
        grads: the flat buffers.
        group_of: per tensor, the wrapped optimizer's param group (-1: not in it).
        optimizer: the wrapped optimizer; its param groups are rebuilt over the shards.
        chan: the channel (rank, world size, serial group).
        zero_stage: 1 or 2 (the flat buffers not stored).
    """

    def __init__(self, schedule: Schedule, grads: FlatGrads, group_of: Sequence[int],
                 optimizer: torch.optim.Optimizer, chan: Channel, zero_stage: int = 1):
        self.grads, self.opt, self.chan = grads, optimizer, chan
        #: 1 (ZeRO-1) or 2 (ZeRO-2: no flat buffer, ``grads.stored`` False; see the module's
        #: *ZeRO-2*), as ``DistributedOptimizer(zero_stage=...)`` was given.
        self.zero_stage = zero_stage
        assert (zero_stage == 2) == (not grads.stored), "ZeRO-2 keeps no flat buffer"
        self.device = grads.device
        #: Tensor indices in the model's parameter order (clip's grouping), set on first use.
        self.param_order: list[int] | None = None
        self.ws, self.rank = chan.world_size, chan.rank
        self._rs = reduce_scatter_issuer(chan.group, chan.serial)
        self._ag = all_gather_issuer(chan.group, chan.serial)
        #: The param groups' own parameter lists (what an unsharded optimizer steps).
        self.orig_params: list[list[torch.Tensor]] = [list(g["params"])
                                                      for g in optimizer.param_groups]
        full = optimizer.state_dict() if len(optimizer.state) else None
        self._block_extents(schedule)
        self._gather_buffers(schedule)
        self._pieces(group_of, len(optimizer.param_groups))
        self._count_pieces()
        self._step_state(len(schedule.blocks))
        self.refresh()
        optimizer.state.clear()
        for grp, members in zip(optimizer.param_groups, self.by_group):
            grp["params"] = [sp for sp, _, _ in members]
        #: The collective state-dict calls (a lone one fails on every rank in one line).
        self.book = CallBook(chan)
        chan.cause = self.book.cause
        if full is not None:  # state loaded before wrapping: sharded like a loaded one
            self.load_full(full)

    def _block_extents(self, schedule: Schedule) -> None:
        """Each block's start in its flat buffer, its length ``L``, its shard length ``S``
        (``L / world_size`` rounded up) and its buffer."""
        grads, ws = self.grads, self.ws
        self.lo: list[int] = []          # block start in its flat buffer
        self.length: list[int] = []      # block length L
        self.size: list[int] = []        # shard length S
        self.buffer: list[int] = []
        for k, blk in enumerate(schedule.blocks):
            view = grads.block_views[k]
            flat = grads.flats[blk.buffer]
            self.lo.append(int(view.storage_offset() - flat.storage_offset()))
            self.length.append(view.numel())
            self.size.append(-(-view.numel() // ws))
            self.buffer.append(blk.buffer)

    def _gather_buffers(self, schedule: Schedule) -> None:
        """The all-gathers (``schedule.gather_groups()``), their inputs and outputs, the
        parameter shards (views of the inputs) and the reduce-scatters' staging inputs."""
        grads, ws, dev = self.grads, self.ws, self.device
        m = len(schedule.blocks)
        #: The all-gathers in issue order, each the blocks it gathers (``gather_groups()``).
        self.gathers: tuple[tuple[int, ...], ...] = schedule.gather_groups()
        self.group_of = [0] * m          # block -> its all-gather
        self.offset = [0] * m            # block's shard offset in its all-gather's input
        #: Per all-gather: its input (this rank's shards of its blocks, concatenated; the
        #: parameter shards ``pshard[k]`` are views of it) and its output (``None``: a
        #: single block with no padding, gathered straight into its flat view).
        self.g_in: list[torch.Tensor] = []
        self.g_out: list[torch.Tensor | None] = []
        #: Per block: the reduce-scatter's staging input (``None``: the flat view itself).
        self.stage: list[torch.Tensor | None] = [None] * m
        self.pshard: list[torch.Tensor] = [torch.empty(0)] * m
        for i, blocks in enumerate(self.gathers):
            total = 0
            for k in blocks:
                self.group_of[k], self.offset[k] = i, total
                total += self.size[k]
            dtype = grads.block_views[blocks[0]].dtype
            gin = torch.zeros(total, dtype=dtype, device=dev)
            self.g_in.append(gin)
            direct = len(blocks) == 1 and self.size[blocks[0]] * ws == self.length[blocks[0]]
            # ZeRO-2: every output is a staging tensor, allocated at each gather().
            out = None if direct or self.zero_stage == 2 else torch.zeros(ws * total, dtype=dtype,
                                                                device=dev)
            self.g_out.append(out)
            for k in blocks:
                self._block_shards(k, gin, out, dtype)

    def _block_shards(self, k: int, gin: torch.Tensor, out: torch.Tensor | None,
                      dtype: torch.dtype) -> None:
        """Block ``k``'s parameter shard (a view of its all-gather's input ``gin``) and, for
        a padded block, its reduce-scatter's staging input."""
        ws, off, sk = self.ws, self.offset[k], self.size[k]
        self.pshard[k] = gin[off:off + sk]
        if out is not None and sk * ws != self.length[k]:
            # A padded block's reduce-scatter input: its own range of the all-gather's
            # output (disjoint per block; every gathered value is copied out before
            # the next backward writes a gradient there).
            self.stage[k] = out[ws * off:ws * (off + sk)]
        elif sk * ws != self.length[k] and self.zero_stage != 2:
            self.stage[k] = torch.zeros(ws * sk, dtype=dtype, device=self.device)

    def _pieces(self, group_of: Sequence[int], n_groups: int) -> None:
        """This rank's pieces of the tensors (one per block and tensor its shard covers),
        the reduce-scatter outputs, and a shard parameter per piece the optimizer steps,
        by its param group (``group_of``: per tensor, -1 for none)."""
        grads, r = self.grads, self.rank
        self.rs_out: list[torch.Tensor] = []
        #: This rank's pieces: (block, tensor, start, end), flat-buffer coordinates.
        self.pieces: list[tuple[int, int, int, int]] = []
        #: Per piece, its shard parameter (None: the tensor is not in the optimizer).
        self.shard_params: list[torch.nn.Parameter | None] = []
        by_group: list[list[tuple[torch.nn.Parameter, int, torch.Tensor]]] = [
            [] for _ in range(n_groups)]
        for k in range(len(self.lo)):
            view = grads.block_views[k]
            lo, n, s = self.lo[k], self.length[k], self.size[k]
            out = torch.zeros(s, dtype=view.dtype, device=self.device)
            ps = self.pshard[k]
            self.rs_out.append(out)
            olo, ohi = lo + r * s, min(lo + (r + 1) * s, lo + n)
            for t in grads.block_tensors[k]:
                _, ts, te = grads.region[t]
                a, e = max(ts, olo), min(te, ohi)
                if a >= e:
                    continue
                self.pieces.append((k, t, a, e))
                gi = group_of[t]
                if gi < 0:
                    self.shard_params.append(None)
                    continue
                sp = torch.nn.Parameter(ps[a - olo:e - olo])
                self.shard_params.append(sp)
                by_group[gi].append((sp, t, out[a - olo:e - olo]))
        self.by_group = by_group
        #: Per piece, its view of the reduce-scatter output (the averaged gradient's shard).
        self.piece_grads = [self.rs_out[k][a - (self.lo[k] + r * self.size[k]):
                                           e - (self.lo[k] + r * self.size[k])]
                            for k, _, a, e in self.pieces]

    def _count_pieces(self) -> None:
        """Per tensor, how many pieces it is cut into over all ranks (1: one rank holds it
        whole, and computes its norm as torch does)."""
        grads = self.grads
        self.npieces = [0] * grads.n
        for k in range(len(self.lo)):
            lo, n, s = self.lo[k], self.length[k], self.size[k]
            for t in grads.block_tensors[k]:
                _, ts, te = grads.region[t]
                for q in range(self.ws):
                    if max(ts, lo + q * s) < min(te, lo + n, lo + (q + 1) * s):
                        self.npieces[t] += 1

    def _step_state(self, m: int) -> None:
        """What changes from step to step: staged gathers, ZeRO-2's block storage, the
        transient memory count, GradScaler's view, the trace (``m`` blocks)."""
        #: Blocks gathered through a staging output, not yet copied into the flat buffer.
        self.unstaged = [False] * m
        #: ZeRO-2: per block, this step's gradient storage (``world_size * S`` elements, the
        #: reduce-scatter's input) until it is issued; the gathered values of a block once
        #: read out of its all-gather's output; per block and per all-gather, what is left
        #: to copy out of them (both go when nothing is).
        self.blk: list[torch.Tensor | None] = [None] * m
        self.contents: list[torch.Tensor | None] = [None] * m
        self.left_t = [0] * m
        self.left_g = [0] * len(self.gathers)
        #: Backward's transient gradient memory alive (weak references and bytes: ZeRO-2's
        #: block storage, an all-to-all's receive buffer; a reduce-scatter in flight holds
        #: its input), its most bytes at once so far, and what frees the storage of the
        #: finished reduce-scatters (``StepComm.reap``, set by ``install``).
        self.live: set[weakref.ref] = set()
        self.live_bytes = 0
        self.peak_grad_bytes = 0
        # A tensor may be freed on a backend's thread (its work let go of it last), or by a
        # garbage collection inside the locked section itself: a reentrant lock.
        self._live_lock = threading.RLock()
        self.reap: Callable[[], None] = lambda: None
        #: GradScaler (:meth:`expose`): the shard gradients shown to it this step, or None;
        #: the sentinel parameter carrying every rank's verdict; this rank's own flag.
        self.exposed: list[torch.Tensor] | None = None
        self.sentinel: torch.nn.Parameter | None = None
        self.found_here: torch.Tensor | None = None
        #: The recorder of the measured timeline (set by ``install``), or None.
        self.trace: Any = None

    # -- the step ----------------------------------------------------------------------------

    def reduce_scatter(self, k: int, streams: Sequence[Any] = ()) -> dist.Work:
        """Issue block ``k``'s reduce-scatter (StepComm's issuer in sharded mode)."""
        if streams:
            cur = torch.cuda.current_stream(self.chan.device)
            for st in streams:
                if st != cur:
                    cur.wait_stream(st)
        if self.zero_stage == 2:
            # The work holds the storage while it runs; the runtime lets go of it now.
            x = self.storage(k)
            self.blk[k] = None
        else:
            x, stage = self.grads.block_views[k], self.stage[k]
            if stage is not None:
                n = x.numel()
                stage[:n].copy_(x)
                stage[n:].zero_()   # the padding (an all-gather may have left values there)
                x = stage
        work = self._rs(self.rs_out[k], x)
        parts = getattr(work, "parts", None)  # an all-to-all's receive buffer (gloo, 2 ranks)
        if parts is not None:
            self._track(parts)
        return work

    # -- ZeRO-2: gradient storage per block ---------------------------------------------

    def _track(self, x: torch.Tensor) -> None:
        """Count ``x`` in :meth:`grad_bytes` until it is freed (a weak reference's callback:
        no scan of what is alive, once per block and step)."""
        nbytes = x.numel() * x.element_size()

        def gone(ref: weakref.ref) -> None:
            with self._live_lock:
                self.live.discard(ref)
                self.live_bytes -= nbytes

        with self._live_lock:
            self.live.add(weakref.ref(x, gone))
            self.live_bytes += nbytes
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.live_bytes)

    def grad_bytes(self) -> int:
        """The bytes of backward's transient gradient memory alive now: ZeRO-2's storage of
        the blocks not issued yet and of those whose reduce-scatter has not been reaped, and
        receive buffers of reduce-scatters not waited for."""
        return self.live_bytes

    def storage(self, k: int) -> torch.Tensor:
        """ZeRO-2: block ``k``'s gradient storage for this step, allocated (zeros: a tensor
        with no gradient, the padding) when first needed, after the storage of the finished
        reduce-scatters has gone."""
        x = self.blk[k]
        if x is None:
            self.reap()
            x = self.blk[k] = torch.zeros(self.size[k] * self.ws, dtype=self.rs_out[k].dtype,
                                          device=self.device)
            self._track(x)
        return x

    def put(self, t: int, grad: torch.Tensor | None, scale: float | None) -> None:
        """ZeRO-2's :meth:`~.buffers.FlatGrads.take`: tensor ``t``'s gradient (times
        ``scale``) into its blocks' storage, laid out as its view in a flat buffer would be
        (so the sums are those of ZeRO-1 and DDP); ``p.grad`` becomes the placeholder and the
        gradient's own memory goes. ``None``: zeros (the storage starts so)."""
        g = self.grads
        p = g.params[t]
        if grad is not None:
            _, s0, e0 = g.region[t]
            ks = g.tensor_blocks[t]
            with torch.no_grad():
                one = len(ks) == 1
                if one:
                    k = ks[0]
                    dst = _like(p, self.storage(k), s0 - self.lo[k])
                else:   # cut by a block boundary: laid out once, then copied in parts
                    tmp = torch.empty(e0 - s0, dtype=p.dtype, device=self.device)
                    dst = _like(p, tmp, 0)
                if scale is None:
                    dst.copy_(grad)
                else:
                    torch.mul(grad, scale, out=dst)
                if not one:
                    for k in ks:
                        lo = self.lo[k]
                        a, e = max(s0, lo), min(e0, lo + self.length[k])
                        if a < e:
                            self.storage(k)[a - lo:e - lo].copy_(tmp[a - s0:e - s0])
                if g.cuda and grad.is_cuda:
                    grad.record_stream(torch.cuda.current_stream(grad.device))
        p.grad = g.views[t]

    def content(self, k: int) -> torch.Tensor:
        """ZeRO-2: block ``k``'s gathered values (``L`` elements, flat-buffer layout): a view
        of its all-gather's output when the block is gathered alone, else a copy of its
        ``(world_size, S)`` slice."""
        c = self.contents[k]
        if c is None:
            out = self.g_out[self.group_of[k]]
            assert out is not None
            off, s = self.offset[k], self.size[k]
            c = self.contents[k] = out.view(self.ws, -1)[:, off:off + s].reshape(-1)[
                :self.length[k]]
        return c

    def refresh(self) -> None:
        """Copy this rank's pieces of the parameters into the parameter shards."""
        params, lo, size, r = self.grads.params, self.lo, self.size, self.rank
        flats: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for k, t, a, e in self.pieces:
                src = flats.get(t)
                if src is None:
                    src = flats[t] = _flat_of(params[t])
                ts = self.grads.region[t][1]
                olo = lo[k] + r * size[k]
                self.pshard[k][a - olo:e - olo].copy_(src[a - ts:e - ts])

    def step(self, include: Callable[[int], bool], zeroed: bool) -> list[dist.Work | None]:
        """Step this rank's shards (the reduce-scatters waited for), then issue the
        all-gathers of the parameters (:meth:`gather`); returns their works, one per block
        (the pending updates of :class:`GatherBack`). ``zeroed``:
        ``zero_grad(set_to_none=False)`` ran after backward."""
        if zeroed:
            for out in self.rs_out:
                out.zero_()
        self.refresh()
        groups = self.opt.param_groups
        saved = [grp["params"] for grp in groups]
        try:
            for grp, members in zip(groups, self.by_group):
                sub = []
                for sp, t, g in members:
                    if include(t):
                        sp.grad = g
                        sub.append(sp)
                grp["params"] = sub
            with torch.inference_mode(False):
                inner_step(self.opt)
        finally:
            for grp, params in zip(groups, saved):
                grp["params"] = params
            for members in self.by_group:
                for sp, _, _ in members:
                    sp.grad = None
        return self.gather()

    def gather(self) -> list[dist.Work | None]:
        """Issue the all-gathers of the parameter shards, one per group of
        :attr:`gathers`, in that order; returns the work of each block (the blocks of one
        group share one)."""
        views = self.grads.block_views
        works: list[dist.Work | None] = [None] * len(self.pshard)
        for i, grp in enumerate(self.gathers):
            out = self.g_out[i]
            if self.zero_stage == 2:   # a fresh staging output (the last step's is gone by now)
                self.g_out[i] = None
                gin = self.g_in[i]
                out = self.g_out[i] = torch.empty(self.ws * gin.numel(), dtype=gin.dtype,
                                                  device=self.device)
                self.left_g[i] = len(grp)
                for k in grp:
                    self.contents[k] = None
                    self.left_t[k] = len(self.grads.block_tensors[k])
            w = self._ag(views[grp[0]] if out is None else out, self.g_in[i])
            if self.trace is not None:
                self.trace.gather(i, w)
            for k in grp:
                works[k] = w
                self.unstaged[k] = out is not None
        return works

    def order(self) -> list[int]:
        """The blocks in the order their all-gathers are issued (and, on one channel, end)."""
        return [k for grp in self.gathers for k in grp]

    def what(self, k: int) -> str:
        grp = self.gathers[self.group_of[k]]
        if len(grp) == 1:
            return f"all-gather of block {k}'s parameters"
        return f"all-gather of blocks {', '.join(map(str, grp))}'s parameters"

    def unstage(self, k: int) -> None:
        """Block ``k``'s part of its all-gather's staging output into its flat view: the
        ``(world_size, S)`` slice of the rank-major output, its first ``L`` elements."""
        out = self.g_out[self.group_of[k]]
        assert out is not None
        n, s, off = self.length[k], self.size[k], self.offset[k]
        rows = out.view(self.ws, -1)[:, off:off + s]
        dst = self.grads.block_views[k]
        q = n // s
        if q:
            dst[:q * s].view(q, s).copy_(rows[:q])
        if n > q * s:
            dst[q * s:].copy_(rows[q, :n - q * s])
        self.unstaged[k] = False

    def copy_back(self, ts: Sequence[int]) -> None:
        """Tensors ``ts``, whose blocks' all-gathers have finished: their gathered values (in
        the flat buffer, out of a staging tensor first) into the parameters."""
        g = self.grads
        if self.zero_stage == 2:
            self._copy_back_unstored(ts)
            return
        with torch.no_grad():
            for t in ts:
                for k in g.tensor_blocks[t]:
                    if self.unstaged[k]:
                        self.unstage(k)
                g.params[t].copy_(g.views[t])

    def _copy_back_unstored(self, ts: Sequence[int]) -> None:
        """ZeRO-2's :meth:`copy_back`: straight from the staging outputs into the parameters;
        a block's gathered values go once its tensors are all copied, an all-gather's output
        once its blocks' are."""
        g, lo, length = self.grads, self.lo, self.length
        with torch.no_grad():
            for t in ts:
                p = g.params[t]
                _, s0, e0 = g.region[t]
                ks = g.tensor_blocks[t]
                if len(ks) == 1:
                    p.copy_(_like(p, self.content(ks[0]), s0 - lo[ks[0]]))
                else:
                    tmp = torch.empty(e0 - s0, dtype=p.dtype, device=self.device)
                    for k in ks:
                        a, e = max(s0, lo[k]), min(e0, lo[k] + length[k])
                        if a < e:
                            tmp[a - s0:e - s0].copy_(self.content(k)[a - lo[k]:e - lo[k]])
                    p.copy_(_like(p, tmp, 0))
                for k in ks:
                    self.left_t[k] -= 1
                    if self.left_t[k] == 0:
                        self.contents[k] = None
                        i = self.group_of[k]
                        self.left_g[i] -= 1
                        if self.left_g[i] == 0:
                            self.g_out[i] = None

    # -- reductions over the shards -----------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: Any, what: str) -> None:
        """Reduce ``x`` (on the gradients' device) over the ranks with ``op``, in place, on the
        blocks' channel (nothing of the step is in flight there any more), and wait."""
        if self.ws == 1:
            return
        serial = self.chan.serial
        if serial is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            work = serial.allreduce([x], opts)
        else:
            work = dist.all_reduce(x, op=op, group=self.chan.group, async_op=True)
        self.chan.wait(work, what)

    def clip(self, max_norm: float, norm_type: float, counted: Sequence[bool],
             order: Sequence[int], error_if_nonfinite: bool,
             foreach: bool | None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the averaged gradients of the tensors
        ``counted`` (those DDP would leave a gradient in ``p.grad``), which exist only as this
        rank's shards: one all-reduce of a per-tensor vector gives every rank every tensor's
        norm (a sum of the pieces' ``|x|^p`` in float64, or for ``inf`` / ``-inf`` a max, with
        a NaN flag per tensor); a tensor one rank holds whole gets its norm computed there as
        torch computes it (then exact). The total is torch's: the vector norm of the stacked
        per-tensor norms, grouped by dtype in ``order`` (the model's parameter order). The
        shards' gradients are scaled by ``min(max_norm / (total + 1e-6), 1)``; returns the
        total norm. A collective: every rank calls it."""
        norm_type = float(norm_type)
        inf = norm_type in (float("inf"), -float("inf"))
        mine: dict[int, list[int]] = {}
        for i, (_, t, _, _) in enumerate(self.pieces):
            if counted[t]:
                mine.setdefault(t, []).append(i)
        with torch.no_grad():
            vec = self._norm_parts(mine, norm_type)
            # Issued whatever this rank counts (ranks that count differently get different
            # norms, as under DDP, but none waits alone).
            self.all_reduce(vec, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            "all-reduce of the gradient norm's per-tensor parts")
            ts = [t for t in order if counted[t]]
            if not ts:
                return torch.tensor(0.0)
            total = self._total_norm(vec, ts, norm_type)
            if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
                raise RuntimeError(
                    f"The total norm of order {norm_type} for gradients from `parameters` is "
                    "non-finite, so it cannot be clipped. To disable this error and scale the "
                    "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            self._scale_pieces(mine, coef, foreach)
        return total

    def _norm_parts(self, mine: dict[int, list[int]], norm_type: float) -> torch.Tensor:
        """This rank's part of each tensor's norm, from its pieces (``mine``: per tensor
        counted, its piece indices), for the all-reduce: the sum of ``|x|^p`` in float64, a
        tensor held whole here its norm; for ``inf`` / ``-inf`` the max of ``|x|`` (of
        ``-min|x|``), then a NaN flag per tensor."""
        n, pg = self.grads.n, self.piece_grads
        inf = norm_type in (float("inf"), -float("inf"))
        neg = norm_type == -float("inf")
        vec = torch.zeros(2 * n if inf else n, dtype=torch.float64, device=self.device)
        if neg:
            vec[:n] = -float("inf")   # -min|x| under a max: no piece here is -inf
        for t, idx in mine.items():
            if inf:
                vals = torch.stack([(pg[i].abs().min() if neg else pg[i].abs().max())
                                    .double() for i in idx])
                nan = vals.isnan()
                vals = -vals if neg else vals
                vec[t] = vals.masked_fill(nan, -float("inf")).max()
                vec[n + t] = nan.any().double()
            elif self.npieces[t] == 1:
                vec[t] = torch.linalg.vector_norm(pg[idx[0]], norm_type).double()
            else:
                acc = torch.zeros((), dtype=torch.float64, device=self.device)
                for i in idx:
                    x = pg[i].double()
                    acc += (x != 0).sum() if norm_type == 0 else \
                        torch.linalg.vector_norm(x, norm_type) ** norm_type
                vec[t] = acc
        return vec

    def _total_norm(self, vec: torch.Tensor, ts: Sequence[int], norm_type: float) -> torch.Tensor:
        """torch's total from the all-reduced parts ``vec``: each tensor of ``ts`` (the
        model's parameter order) its norm in its dtype, their vector norm, grouped by dtype."""
        g, n = self.grads, self.grads.n
        inf = norm_type in (float("inf"), -float("inf"))
        neg = norm_type == -float("inf")
        norms: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in ts:
            v = vec[t]
            if inf:
                v = torch.where(vec[n + t] > 0, float("nan"), -v if neg else v)
            elif self.npieces[t] != 1 and norm_type != 0:
                v = v ** (1.0 / norm_type)
            dt = g.views[t].dtype
            norms.setdefault(dt, []).append(v.to(dt))
        return torch.linalg.vector_norm(torch.stack([v for vs in norms.values() for v in vs]),
                                        norm_type)

    def _scale_pieces(self, mine: dict[int, list[int]], coef: torch.Tensor,
                      foreach: bool | None) -> None:
        """Scale the counted pieces' gradient shards by ``coef`` in place, by dtype."""
        pg = self.piece_grads
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for idx in mine.values():
            for i in idx:
                by_dtype.setdefault(pg[i].dtype, []).append(pg[i])
        for grads in by_dtype.values():
            if foreach is False:
                for x in grads:
                    x.mul_(coef)
            else:
                torch._foreach_mul_(grads, coef)

    # -- GradScaler ------------------------------------------------------------------------

    def expose(self, counted: Sequence[bool]) -> None:
        """Show a ``GradScaler`` reading ``param_groups`` after the step's last backward (the
        reduce-scatters waited for) the averaged gradients there are: each shard parameter
        of a tensor in ``counted`` (stepped, with a gradient) gets its shard of the gradient
        as ``.grad``, so that ``scaler.unscale_()`` unscales the shards in place. Whether any
        rank's shards hold a non-finite value is one all-reduce (MAX) of this rank's flag;
        the verdict is carried by a one-element sentinel parameter appended to the last
        param group until ``step()`` (``inf`` or ``0``), so the scaler's own ``found_inf``,
        which decides its step and its scale update, is every rank's. A collective: every
        rank's scaler reads ``param_groups`` at the same point."""
        if self.exposed is not None:
            return
        dev = self.device
        shown: list[torch.Tensor] = []
        for group in self.by_group:
            for sp, t, grad in group:
                if counted[t]:
                    sp.grad = grad
                    shown.append(grad)
        found = torch.zeros(1, dtype=torch.float32, device=dev)
        one = torch.ones((), dtype=torch.float32, device=dev)
        with torch.no_grad():
            for same in _by_dtype(shown):
                torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
            self.found_here = found.clone()
            self.all_reduce(found, dist.ReduceOp.MAX, "all-reduce of the non-finite flag")
        if self.sentinel is None:
            self.sentinel = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32, device=dev))
        self.sentinel.grad = torch.where(found > 0, float("inf"), 0.0)
        self.opt.param_groups[-1]["params"].append(self.sentinel)
        self.exposed = shown

    def unexpose(self) -> list[torch.Tensor]:
        """End :meth:`expose` (at ``step()``): the param groups and the shard parameters'
        ``.grad`` as they were; returns the shard gradients that were shown."""
        shown, self.exposed = self.exposed or [], None
        if self.sentinel is not None:
            params = self.opt.param_groups[-1]["params"]
            if params and params[-1] is self.sentinel:
                params.pop()
            self.sentinel.grad = None
        for group in self.by_group:
            for sp, _, _ in group:
                sp.grad = None
        return shown

    def unscale(self, shown: Sequence[torch.Tensor], grad_scale: torch.Tensor) -> None:
        """Divide the shard gradients ``shown`` by ``grad_scale`` in place, as the scaler's
        ``unscale_`` does (the reciprocal taken in float64)."""
        dev = self.device
        inv = grad_scale.double().reciprocal().float().to(dev)
        dummy = torch.zeros(1, dtype=torch.float32, device=dev)
        with torch.no_grad():
            for same in _by_dtype(shown):
                torch._amp_foreach_non_finite_check_and_unscale_(same, dummy, inv)

    # -- state dicts -------------------------------------------------------------------------

    def _plain(self, cpu: bool = False) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
        """An unsharded optimizer of the same class with the current hyperparameters (no
        state), and its parameter per tensor index: the original parameters, or with ``cpu``
        uninitialised host stand-ins of them (loading a full state there keeps it off the
        device)."""
        g = self.grads
        index = {id(p): t for t, p in enumerate(g.params)}
        stand: list[torch.Tensor] = list(g.params)
        groups = []
        for grp, ps in zip(self.opt.param_groups, self.orig_params):
            if cpu:
                ps = [torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu")
                      for p in ps]
            groups.append({**{k: v for k, v in grp.items() if k != "params"}, "params": ps})
        plain = type(self.opt)(groups)  # type: ignore[call-arg]  # SGD, Adam, AdamW: lr has a default
        for ps, grp in zip(self.orig_params, plain.param_groups):
            for p, q in zip(ps, grp["params"]):
                if id(p) in index:
                    stand[index[id(p)]] = q
        return plain, stand

    def _set_hyper(self, groups: Sequence[dict[str, Any]]) -> None:
        """The hyperparameters of ``groups`` (the wrapped optimizer's count of them) into the
        wrapped optimizer's own group dicts, in place (an LR scheduler keeps acting on them)."""
        for grp, pg in zip(self.opt.param_groups, groups):
            for key, v in pg.items():
                if key != "params":
                    grp[key] = v

    def _install_state(self, states: dict[int, dict[str, Any]], copy: bool) -> None:
        """Per piece index, its state (the rest get none), cast as torch's own
        ``load_state_dict`` casts it: to the shard's device and dtype, ``step`` left where it
        is unless the group is fused or capturable. ``copy``: never alias a given tensor."""
        group_of = {id(sp): grp for grp, members in zip(self.opt.param_groups, self.by_group)
                    for sp, _, _ in members}
        self.opt.state.clear()
        for i, st in states.items():
            sp = self.shard_params[i]
            assert sp is not None
            grp = group_of[id(sp)]
            new: dict[str, Any] = {}
            for key, v in st.items():
                if not torch.is_tensor(v):
                    new[key] = v
                elif key == "step":
                    new[key] = (v.to(dtype=torch.float32, device=sp.device, copy=copy)
                                if grp.get("fused") or grp.get("capturable")
                                else v.clone() if copy else v)
                else:
                    new[key] = v.to(dtype=sp.dtype if sp.is_floating_point() else v.dtype,
                                    device=sp.device, copy=copy)
            self.opt.state[sp] = new

    def full_state(self, what: str = "opt.state_dict()") -> dict[str, Any]:
        """The full state dict, on the host, as an unsharded optimizer over the original
        parameters would give it, gathered from every rank's shards (a collective: every rank
        calls it; :class:`CallBook` refuses a lone call on every rank). What each tensor has
        (its keys, Adam's ``step``) is one host all-reduce on the control group; each block's
        shards of each elementwise key are then all-gathered on the device (one block's
        worth at a time, ``world_size * S`` elements) and copied to the host: the device
        never holds more than that beside the shards."""
        self.book.meet(what)
        keys = sorted(ELEMENTWISE)
        info, steps = self._state_info(keys)
        full = self._gather_elementwise(keys, info)
        return self._unsharded_state_dict(keys, info, steps, full)

    def _state_info(self, keys: Sequence[str]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """What each tensor's state has on any rank, agreed by one host all-reduce on the
        control group: per tensor its step (-1: none), then 1 per elementwise key of ``keys``
        it has (-1: none); and this rank's own ``step`` tensors, by tensor."""
        info = torch.full((self.grads.n, 1 + len(keys)), -1.0, dtype=torch.float64)
        steps: dict[int, torch.Tensor] = {}
        for (_, t, _, _), sp in zip(self.pieces, self.shard_params):
            st = self.opt.state.get(sp) if sp is not None else None
            for key, v in (st or {}).items():
                if key in ELEMENTWISE:
                    info[t, 1 + keys.index(key)] = 1.0
                elif key == "step":
                    steps[t] = v if torch.is_tensor(v) else torch.tensor(float(v))
        if steps:  # one host transfer for them all (capturable / fused: on the device)
            vals = torch.stack([v.detach().reshape(()).double() for v in steps.values()]).cpu()
            for t, v in zip(steps, vals):
                info[t, 0] = v
        work = self.chan.control_all_reduce(info, dist.ReduceOp.MAX)
        if work is not None:
            self.chan.wait_host(work, "all-reduce of the optimizer state's keys and steps")
        return info, steps

    def _gather_elementwise(self, keys: Sequence[str], info: torch.Tensor
                            ) -> dict[tuple[int, str], torch.Tensor]:
        """Each elementwise key of each tensor, whole, on the host: gathered block by block
        (one block's all-gather on the device at a time)."""
        g, m = self.grads, len(self.pshard)
        mine: list[list[tuple[int, int, int, torch.nn.Parameter | None]]] = [[] for _ in range(m)]
        for (k, t, a, e), sp in zip(self.pieces, self.shard_params):
            mine[k].append((t, a, e, sp))
        full: dict[tuple[int, str], torch.Tensor] = {}
        for ki, key in enumerate(keys):
            for k in range(m):
                ts_in = [t for t in g.block_tensors[k] if info[t, 1 + ki] > 0]
                if not ts_in:
                    continue
                host = self._gather_block_state(k, key, mine[k])
                lo, n_k = self.lo[k], self.length[k]
                for t in ts_in:
                    _, t0, t1 = g.region[t]
                    f = full.get((t, key))
                    if f is None:
                        f = full[(t, key)] = torch.zeros(t1 - t0, dtype=host.dtype)
                    a, e = max(t0, lo), min(t1, lo + n_k)
                    f[a - t0:e - t0] = host[a - lo:e - lo]
        return full

    def _gather_block_state(self, k: int, key: str,
                            mine: Sequence[tuple[int, int, int, torch.nn.Parameter | None]]
                            ) -> torch.Tensor:
        """Block ``k``'s values of state ``key``, whole, on the host: this rank's pieces
        (``mine``) put in its shard, the shards all-gathered."""
        lo, n_k, s = self.lo[k], self.length[k], self.size[k]
        dtype = self.rs_out[k].dtype
        olo = lo + self.rank * s
        shard = torch.zeros(s, dtype=dtype, device=self.device)
        for _, a, e, sp in mine:
            v = self.opt.state.get(sp, {}).get(key) if sp is not None else None
            if v is not None:
                shard[a - olo:e - olo].copy_(v)
        if self.ws > 1:
            out = torch.empty(s * self.ws, dtype=dtype, device=self.device)
            self.chan.wait(self._ag(out, shard), f"all-gather of block {k}'s {key}")
        else:
            out = shard
        return out[:n_k].cpu()

    def _unsharded_state_dict(self, keys: Sequence[str], info: torch.Tensor,
                              steps: dict[int, torch.Tensor],
                              full: dict[tuple[int, str], torch.Tensor]) -> dict[str, Any]:
        """The state dict of an unsharded optimizer over host stand-ins of the original
        parameters, holding the gathered state (``full``, emptied) and the steps."""
        g = self.grads
        plain, _ = self._plain(cpu=True)
        index = {id(p): t for t, p in enumerate(g.params)}
        from torch.optim import optimizer as optim_mod

        sdt = getattr(optim_mod, "_get_scalar_dtype", lambda: torch.float32)()
        for ps, grp in zip(self.orig_params, plain.param_groups):
            for p, q in zip(ps, grp["params"]):
                t = index.get(id(p), -1)
                if t < 0 or bool((info[t] < 0).all()):
                    continue
                state: dict[str, Any] = {}
                if info[t, 0] >= 0:
                    v = steps.get(t)
                    state["step"] = (v.detach().to("cpu", copy=True) if v is not None
                                     else torch.tensor(float(info[t, 0]), dtype=sdt))
                for ki, key in enumerate(keys):
                    if info[t, 1 + ki] > 0:
                        state[key] = _like(p, full.pop((t, key)), 0)
                plain.state[q] = state
        return plain.state_dict()

    def load_full(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (an unsharded optimizer's over the original parameters):
        the hyperparameters of its groups, and this rank's pieces of the state. Local; torch's
        own checks and casts run against host stand-ins of the parameters, so the full state
        is never on the device (each piece is copied there)."""
        plain, stand = self._plain(cpu=True)
        plain.load_state_dict(state_dict)   # torch's own checks and casts (on the host)
        self._set_hyper(plain.param_groups)
        g = self.grads
        flats: dict[tuple[int, str], torch.Tensor] = {}
        states: dict[int, dict[str, Any]] = {}
        for i, ((_, t, a, e), sp) in enumerate(zip(self.pieces, self.shard_params)):
            st = plain.state.get(stand[t]) if sp is not None else None
            if not st:
                continue
            t0, t1 = g.region[t][1], g.region[t][2]
            new: dict[str, Any] = {}
            for key, v in st.items():
                if key in ELEMENTWISE and torch.is_tensor(v):
                    f = flats.get((t, key))
                    if f is None:
                        f = torch.zeros(t1 - t0, dtype=v.dtype, device=v.device)
                        with torch.no_grad():
                            _like(stand[t], f, 0).copy_(v)
                        flats[(t, key)] = f
                    new[key] = f[a - t0:e - t0]
                else:
                    new[key] = v
            states[i] = new
        self._install_state(states, copy=True)

    # -- DCP: each rank its own pieces --------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """What a sharded state dict's pieces depend on (the same on every rank)."""
        return {"format": 1, "optimizer": type(self.opt).__name__, "world_size": self.ws,
                "blocks": [[self.buffer[k], self.lo[k], self.length[k]]
                           for k in range(len(self.pshard))]}

    def _plain_index(self) -> list[int]:
        """Per tensor index, its index in the unsharded optimizer's state dict."""
        index = {id(p): t for t, p in enumerate(self.grads.params)}
        out = [-1] * self.grads.n
        i = 0
        for ps in self.orig_params:
            for p in ps:
                if id(p) in index:
                    out[index[id(p)]] = i
                i += 1
        return out

    def _empty_state(self, sp: torch.nn.Parameter, grp: dict[str, Any]) -> dict[str, Any]:
        """The state the wrapped optimizer's class gives a parameter like ``sp`` (keys, dtypes,
        devices) on its first step, as zeros: a one-element probe stepped once, then each
        elementwise key widened to ``sp``'s length."""
        probe = torch.nn.Parameter(torch.zeros(1, dtype=sp.dtype, device=sp.device))
        hyper = {k: v for k, v in grp.items() if k != "params"}
        opt = type(self.opt)([{**hyper, "params": [probe]}])  # type: ignore[call-arg]
        probe.grad = torch.zeros_like(probe)
        with torch.inference_mode(False):
            opt.step()
        out: dict[str, Any] = {}
        for key, v in opt.state.get(probe, {}).items():
            if key in ELEMENTWISE and torch.is_tensor(v):
                out[key] = torch.zeros(sp.numel(), dtype=v.dtype, device=v.device)
            elif torch.is_tensor(v):
                out[key] = torch.zeros_like(v)
            else:
                out[key] = v
        return out

    def sharded_state(self) -> dict[str, Any]:
        """This rank's pieces of the optimizer state for ``torch.distributed.checkpoint``: the
        wrapped optimizer's own state tensors (no copy), each under a key naming its tensor (as
        the unsharded optimizer numbers it), the piece's first element in the tensor and the
        state key (``state.<i>.<first>.<key>``), distinct across ranks; ``present.<rank>``,
        which pieces have state (a piece without gets zeros, so a fresh optimizer's dict has
        every key a checkpoint holds); ``param_groups`` (hyperparameters) and ``layout``
        (:meth:`layout`), the same on every rank. Local."""
        plain_i = self._plain_index()
        group_of = {id(sp): grp for grp, members in zip(self.opt.param_groups, self.by_group)
                    for sp, _, _ in members}
        empty: dict[tuple[int, torch.dtype], dict[str, Any]] = {}
        present = torch.zeros(len(self.pieces), dtype=torch.int8)
        state: dict[str, Any] = {}
        for i, ((_, t, a, _), sp) in enumerate(zip(self.pieces, self.shard_params)):
            if sp is None:
                continue
            st = self.opt.state.get(sp)
            if st:
                present[i] = 1
            else:
                grp = group_of[id(sp)]
                gi = next(j for j, gr in enumerate(self.opt.param_groups) if gr is grp)
                proto = empty.get((gi, sp.dtype))
                if proto is None:
                    proto = empty[(gi, sp.dtype)] = self._empty_state(sp, grp)
                st = {key: (torch.zeros(sp.numel(), dtype=v.dtype, device=v.device)
                            if key in ELEMENTWISE and torch.is_tensor(v)
                            else v.clone() if torch.is_tensor(v) else v)
                      for key, v in proto.items()}
            first = a - self.grads.region[t][1]
            for key, v in st.items():
                state[f"{plain_i[t]}.{first}.{key}"] = v
        groups = [{k: v for k, v in grp.items() if k != "params"} for grp in self.opt.param_groups]
        return {"layout": self.layout(), "param_groups": groups, "state": state,
                f"present.{self.rank}": present}

    def load_sharded(self, sd: dict[str, Any]) -> None:
        """Install a sharded state dict of :meth:`sharded_state` (as ``dcp.load`` filled it in
        place): the hyperparameters, and each piece's state where ``present`` says it has one.
        The tensors are taken as they are (cast only if their device or dtype differ). Local."""
        for name in ("layout", "param_groups", "state", f"present.{self.rank}"):
            if name not in sd:
                raise UsbyteError(f"sharded state dict: no {name!r} entry: expected the dict of "
                                  "opt.sharded_state_dict() (filled in by dcp.load)")
        want, got = self.layout(), sd["layout"]
        if got != want:
            what = next((k for k in want if not isinstance(got, dict) or got.get(k) != want[k]),
                        "format")
            have: Any = got.get(what) if isinstance(got, dict) else got
            mine = want[what]
            if what == "blocks":
                n_have = len(have) if isinstance(have, list) else have
                have, mine = f"{n_have} blocks", f"{len(mine)} blocks (or other bounds)"
            raise UsbyteError(f"sharded state dict: saved with {what} {have}, this run has "
                              f"{mine}: load it with the same world size and schedule (or save "
                              "a full state with opt.state_dict() and load that)")
        if len(sd["param_groups"]) != len(self.opt.param_groups):
            raise UsbyteError(f"sharded state dict: {len(sd['param_groups'])} param groups, the "
                              f"optimizer has {len(self.opt.param_groups)}")
        present = sd[f"present.{self.rank}"]
        plain_i = self._plain_index()
        states: dict[int, dict[str, Any]] = {}
        prefixes: dict[str, int] = {}
        for i, ((_, t, a, _), sp) in enumerate(zip(self.pieces, self.shard_params)):
            if sp is not None and int(present[i]):
                prefixes[f"{plain_i[t]}.{a - self.grads.region[t][1]}."] = i
        for name, v in sd["state"].items():
            head, _, key = name.rpartition(".")
            i = prefixes.get(head + ".", -1)
            if i >= 0:
                states.setdefault(i, {})[key] = v
        self._set_hyper(sd["param_groups"])
        self._install_state(states, copy=False)

    def restore(self) -> None:
        """Give the wrapped optimizer its own parameter lists back (no state)."""
        self.unexpose()
        self.opt.state.clear()
        for grp, ps in zip(self.opt.param_groups, self.orig_params):
            grp["params"] = ps

    # -- memory ---------------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """This rank's memory of sharded mode beside the parameters, in bytes:

        * ``zero_stage``;
        * ``optimizer_state``: the wrapped optimizer's tensors (this rank's shards only);
        * ``shards``: the reduce-scatter outputs (this rank's shards of the averaged gradients)
          and the parameter shards (the all-gathers' inputs), kept;
        * ``kept``: what else is held for the whole run, through forward's activation peak:
          ZeRO-1's flat buffers and its staging tensors; 0 in ZeRO-2;
        * ``backward_peak``: the most transient gradient memory held at once in backward
          (ZeRO-2's block storage, counted while a reduce-scatter holds it; on gloo with 2
          ranks the all-to-all receive buffers, in either stage);
        * ``gather_staging``: ZeRO-2's all-gather outputs, allocated at each ``step()`` and
          gone as the next forward copies them out (in ZeRO-1 they are part of ``kept``).
        """
        def nbytes(ts: Sequence[torch.Tensor | None]) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        state = sum(v.numel() * v.element_size() for st in self.opt.state.values()
                    for v in st.values() if torch.is_tensor(v))
        staging = sum(self.ws * g.numel() * g.element_size()
                      for i, g in enumerate(self.g_in) if self.zero_stage == 2 or self.g_out[i] is not None)
        return {"zero_stage": self.zero_stage, "optimizer_state": state,
                "shards": nbytes(self.rs_out) + nbytes(self.g_in),
                "kept": 0 if self.zero_stage == 2 else nbytes(self.grads.flats) + staging
                + nbytes([t for t in self.stage if t is not None and t._base is None]),
                "backward_peak": self.peak_grad_bytes,
                "gather_staging": staging if self.zero_stage == 2 else 0}

    # -- checks --------------------------------------------------------------------------

    def coverage(self) -> list[tuple[int, int, int]]:
        """This rank's pieces as (buffer, start, end) in flat-buffer coordinates."""
        return [(self.buffer[k], a, e) for k, _, a, e in self.pieces]

    def require(self, what: str) -> None:
        raise UsbyteError(f"{what} is not supported in sharded mode: the averaged gradients "
                          "exist only as shards")

    def refuse_grad_access(self, what: str) -> None:
        """User code read ``p.grad`` between the step's last backward and ``step()``: under
        DDP it would see the averaged gradient, which sharded mode never has whole."""
        raise UsbyteError(f"{what} between backward() and step() in sharded mode: the averaged "
                          "gradient exists only as shards here (DDP would show it whole); clip "
                          "with opt.clip_grad_norm_(), or plan an all-reduce schedule")
