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

import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.issuers import all_gather_issuer, reduce_scatter_issuer
from ..errors import DistributedError, UsbyteError, first_line
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


class Sharded:
    """The sharded state of one installed schedule.

    Args:
        schedule: the schedule (its blocks' buffers).
        grads: the flat buffers.
        group_of: per tensor, the wrapped optimizer's param group (-1: not in it).
        optimizer: the wrapped optimizer; its param groups are rebuilt over the shards.
        chan: the channel (rank, world size, serial group).
    """

    def __init__(self, schedule: Schedule, grads: FlatGrads, group_of: Sequence[int],
                 optimizer: torch.optim.Optimizer, chan: Channel):
        self.grads, self.opt, self.chan = grads, optimizer, chan
        #: ZeRO-2: no flat buffer (``grads.stored`` is False); see the module's *ZeRO-2*.
        self.zero2 = not grads.stored
        dev = self.device = grads.device
        #: Tensor indices in the model's parameter order (clip's grouping), set on first use.
        self.param_order: list[int] | None = None
        ws, r = chan.world_size, chan.rank
        self.ws, self.rank = ws, r
        self._rs = reduce_scatter_issuer(chan.group, chan.serial)
        self._ag = all_gather_issuer(chan.group, chan.serial)
        #: The param groups' own parameter lists (what an unsharded optimizer steps).
        self.orig_params: list[list[torch.Tensor]] = [list(g["params"])
                                                      for g in optimizer.param_groups]
        full = optimizer.state_dict() if len(optimizer.state) else None
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
            out = None if direct or self.zero2 else torch.zeros(ws * total, dtype=dtype,
                                                                device=dev)
            self.g_out.append(out)
            for k in blocks:
                off, sk = self.offset[k], self.size[k]
                self.pshard[k] = gin[off:off + sk]
                if out is not None and sk * ws != self.length[k]:
                    # A padded block's reduce-scatter input: its own range of the all-gather's
                    # output (disjoint per block; every gathered value is copied out before
                    # the next backward writes a gradient there).
                    self.stage[k] = out[ws * off:ws * (off + sk)]
                elif sk * ws != self.length[k] and not self.zero2:
                    self.stage[k] = torch.zeros(ws * sk, dtype=dtype, device=dev)
        self.rs_out: list[torch.Tensor] = []
        #: This rank's pieces: (block, tensor, start, end), flat-buffer coordinates.
        self.pieces: list[tuple[int, int, int, int]] = []
        #: Per piece, its shard parameter (None: the tensor is not in the optimizer).
        self.shard_params: list[torch.nn.Parameter | None] = []
        by_group: list[list[tuple[torch.nn.Parameter, int, torch.Tensor]]] = [
            [] for _ in optimizer.param_groups]
        for k in range(m):
            view = grads.block_views[k]
            lo, n, s = self.lo[k], self.length[k], self.size[k]
            out = torch.zeros(s, dtype=view.dtype, device=dev)
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
        #: Per tensor, how many pieces it is cut into over all ranks (1: one rank holds it
        #: whole, and computes its norm as torch does).
        self.npieces = [0] * grads.n
        for k in range(m):
            lo, n, s = self.lo[k], self.length[k], self.size[k]
            for t in grads.block_tensors[k]:
                _, ts, te = grads.region[t]
                for q in range(ws):
                    if max(ts, lo + q * s) < min(te, lo + n, lo + (q + 1) * s):
                        self.npieces[t] += 1
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
        self.refresh()
        optimizer.state.clear()
        for grp, members in zip(optimizer.param_groups, by_group):
            grp["params"] = [sp for sp, _, _ in members]
        if full is not None:  # state loaded before wrapping: sharded like a loaded one
            self.load_full(full)

    # -- the step ----------------------------------------------------------------------------

    def reduce_scatter(self, k: int, streams: Sequence[Any] = ()) -> dist.Work:
        """Issue block ``k``'s reduce-scatter (StepComm's issuer in sharded mode)."""
        if streams:
            cur = torch.cuda.current_stream(self.chan.device)
            for st in streams:
                if st != cur:
                    cur.wait_stream(st)
        if self.zero2:
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
            if self.zero2:   # a fresh staging output (the last step's is gone by now)
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
        if self.zero2:
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
        g = self.grads
        n = g.n
        norm_type = float(norm_type)
        ts = [t for t in order if counted[t]]
        dev = self.device
        inf = norm_type in (float("inf"), -float("inf"))
        neg = norm_type == -float("inf")
        whole = [self.npieces[t] == 1 for t in range(n)]
        mine: dict[int, list[int]] = {}
        for i, (_, t, _, _) in enumerate(self.pieces):
            if counted[t]:
                mine.setdefault(t, []).append(i)
        vec = torch.zeros(2 * n if inf else n, dtype=torch.float64, device=dev)
        if neg:
            vec[:n] = -float("inf")   # -min|x| under a max: no piece here is -inf
        pg = self.piece_grads
        with torch.no_grad():
            for t, idx in mine.items():
                if inf:
                    vals = torch.stack([(pg[i].abs().min() if neg else pg[i].abs().max())
                                        .double() for i in idx])
                    nan = vals.isnan()
                    vals = -vals if neg else vals
                    vec[t] = vals.masked_fill(nan, -float("inf")).max()
                    vec[n + t] = nan.any().double()
                elif whole[t]:
                    vec[t] = torch.linalg.vector_norm(pg[idx[0]], norm_type).double()
                else:
                    acc = torch.zeros((), dtype=torch.float64, device=dev)
                    for i in idx:
                        x = pg[i].double()
                        acc += (x != 0).sum() if norm_type == 0 else \
                            torch.linalg.vector_norm(x, norm_type) ** norm_type
                    vec[t] = acc
            # Issued whatever this rank counts (ranks that count differently get different
            # norms, as under DDP, but none waits alone).
            self.all_reduce(vec, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            "all-reduce of the gradient norm's per-tensor parts")
            if not ts:
                return torch.tensor(0.0)
            norms: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in ts:
                v = vec[t]
                if inf:
                    v = torch.where(vec[n + t] > 0, float("nan"), -v if neg else v)
                elif not whole[t] and norm_type != 0:
                    v = v ** (1.0 / norm_type)
                dt = g.views[t].dtype
                norms.setdefault(dt, []).append(v.to(dt))
            total = torch.linalg.vector_norm(
                torch.stack([v for vs in norms.values() for v in vs]), norm_type)
            if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
                raise RuntimeError(
                    f"The total norm of order {norm_type} for gradients from `parameters` is "
                    "non-finite, so it cannot be clipped. To disable this error and scale the "
                    "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
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
        return total

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

    def _plain(self) -> torch.optim.Optimizer:
        """An unsharded optimizer of the same class over the original parameters, with the
        current hyperparameters (no state)."""
        groups = [{**{k: v for k, v in grp.items() if k != "params"}, "params": ps}
                  for grp, ps in zip(self.opt.param_groups, self.orig_params)]
        return type(self.opt)(groups)  # type: ignore[call-arg]  # SGD, Adam, AdamW: lr has a default

    def full_state(self) -> dict[str, Any]:
        """The full state dict, as an unsharded optimizer over the original parameters would
        give it, gathered from every rank's shards (a collective: every rank calls it). The
        ranks first meet at a monitored barrier: a rank that calls it while another does not
        (``if rank == 0: save(opt.state_dict())``) raises within :data:`STATE_DICT_WAIT_S`
        (or the optimizer's shorter ``timeout``), naming the ranks that did not come."""
        ctl = self.chan.control
        if ctl is not None:
            limit = STATE_DICT_WAIT_S
            if self.chan.host_timeout is not None:
                limit = min(limit, self.chan.host_timeout.total_seconds())
            try:
                # Not in torch's stubs for ProcessGroup; gloo's backend has it.
                ctl.monitored_barrier(timedelta(seconds=limit), True)  # type: ignore[attr-defined]
            except RuntimeError as err:
                raise DistributedError(
                    f"rank {self.rank}: opt.state_dict() in sharded mode is a collective (it "
                    "gathers every rank's shards): call it on every rank and save on rank 0; "
                    f"waited {limit:g} s: {first_line(err)}") from err
        g = self.grads
        meta: dict[int, dict[str, Any]] = {}
        for (_, t, _, _), sp in zip(self.pieces, self.shard_params):
            st = self.opt.state.get(sp) if sp is not None else None
            if not st:
                continue
            d = meta.setdefault(t, {})
            for key, v in st.items():
                d[key] = ("e", v.dtype) if key in ELEMENTWISE and torch.is_tensor(v) else ("v", v)
        metas: list[Any] = [None] * self.ws
        dist.all_gather_object(metas, meta, group=self.chan.group)
        merged: dict[int, dict[str, Any]] = {}
        for mt in metas:
            for t, d in mt.items():
                merged.setdefault(t, {}).update(d)
        # Elementwise keys: a flat buffer per (buffer, key), every block's shards gathered.
        wanted: dict[tuple[int, str], torch.dtype] = {}
        for t, d in merged.items():
            for key, (kind, val) in d.items():
                if kind == "e":
                    wanted[(g.region[t][0], key)] = val
        full: dict[tuple[int, str], torch.Tensor] = {}
        for (b, key), dtype in sorted(wanted.items(), key=lambda x: x[0]):
            flat = torch.zeros(g.flats[b].numel(), dtype=dtype, device=self.device)
            for k in range(len(self.pshard)):
                if self.buffer[k] != b:
                    continue
                shard = torch.zeros(self.size[k], dtype=dtype, device=flat.device)
                olo = self.lo[k] + self.rank * self.size[k]
                for (pk, _t, a, e), sp in zip(self.pieces, self.shard_params):
                    if pk == k and sp is not None and key in self.opt.state.get(sp, {}):
                        shard[a - olo:e - olo].copy_(self.opt.state[sp][key])
                out = torch.zeros(self.size[k] * self.ws, dtype=dtype, device=flat.device)
                self.chan.wait(self._ag(out, shard), f"all-gather of block {k}'s {key}")
                flat[self.lo[k]:self.lo[k] + self.length[k]].copy_(out[:self.length[k]])
            full[(b, key)] = flat
        plain = self._plain()
        for t, d in merged.items():
            p = g.params[t]
            b, ts, _ = g.region[t]
            state: dict[str, Any] = {}
            for key, (kind, val) in d.items():
                if kind == "e":
                    state[key] = _like(p, full[(b, key)], ts).clone()
                else:
                    state[key] = val.clone() if torch.is_tensor(val) else val
            plain.state[p] = state
        return plain.state_dict()

    def load_full(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (an unsharded optimizer's over the original parameters):
        the hyperparameters of its groups, and this rank's pieces of the state. Local."""
        plain = self._plain()
        plain.load_state_dict(state_dict)   # torch's own checks and casts
        for grp, pg in zip(self.opt.param_groups, plain.param_groups):
            for key, v in pg.items():
                if key != "params":
                    grp[key] = v
        self.opt.state.clear()
        g = self.grads
        flats: dict[tuple[int, str], torch.Tensor] = {}
        for (_, t, a, e), sp in zip(self.pieces, self.shard_params):
            if sp is None:
                continue
            p = g.params[t]
            st = plain.state.get(p)
            if not st:
                continue
            ts, te = g.region[t][1], g.region[t][2]
            new: dict[str, Any] = {}
            for key, v in st.items():
                if key in ELEMENTWISE and torch.is_tensor(v):
                    f = flats.get((t, key))
                    if f is None:
                        f = torch.zeros(te - ts, dtype=v.dtype, device=v.device)
                        with torch.no_grad():
                            _like(p, f, 0).copy_(v)
                        flats[(t, key)] = f
                    new[key] = f[a - ts:e - ts].clone()
                else:
                    new[key] = v.clone() if torch.is_tensor(v) else v
            self.opt.state[sp] = new

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
                      for i, g in enumerate(self.g_in) if self.zero2 or self.g_out[i] is not None)
        return {"zero_stage": 2 if self.zero2 else 1, "optimizer_state": state,
                "shards": nbytes(self.rs_out) + nbytes(self.g_in),
                "kept": 0 if self.zero2 else nbytes(self.grads.flats) + staging
                + nbytes([t for t in self.stage if t is not None and t._base is None]),
                "backward_peak": self.peak_grad_bytes,
                "gather_staging": staging if self.zero2 else 0}

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
