"""Sharded mode (``Mode.SHARDED``): ZeRO-1 on the schedule's blocks (docs/runtime.md).

**Shard layout.** Every block of the schedule is sharded on its own: block ``k`` covers the
element range ``[lo, hi)`` of its flat buffer (:class:`~.buffers.FlatGrads`, alignment padding
included), of length ``L``; with ``S = ceil(L / world_size)``, rank ``r`` owns
``[lo + r*S, min(lo + (r+1)*S, hi))``. The flat buffers keep their layout; a block whose length
is not a multiple of the world size goes through a staging tensor of ``world_size * S``
elements (the block, then zeros), for the reduce-scatter in and the all-gather out.

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
optimizer on the shards, and issue the all-gather of every block's parameter shard into the
flat buffer (the gradients there are dead by then), in schedule order. The copy of a tensor's
gathered values into its parameter is its pending update (:class:`GatherBack`, run by
:class:`~.updates.HostUpdates`): the forward pre-hook of the tensor's module waits for that
tensor's blocks only, as overlap mode does for its updates, so the all-gathers of later
tensors overlap the forward; the next backward, an eval forward, ``synchronize()`` and the
state-dict hooks apply what is left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.issuers import all_gather_issuer, reduce_scatter_issuer
from ..errors import UsbyteError
from ..formats import Schedule
from .buffers import FlatGrads, dense_strides
from .comm import Channel

#: The optimizers sharded mode steps: elementwise updates, whose state it can shard.
SHARDABLE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.Adam,
                                                      torch.optim.AdamW)
#: Their per-element state (shaped like the parameter); every other key is one value per tensor.
ELEMENTWISE = frozenset({"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})


def check_sharded(optimizer: torch.optim.Optimizer, *, wait_in_backward: bool,
                  compiled: bool) -> None:
    """Refuse, in one line, what sharded mode does not support (at construction)."""
    if type(optimizer) not in SHARDABLE:
        raise UsbyteError(f"sharded mode: {type(optimizer).__name__} is not supported: it steps "
                          "a shard of each tensor, which needs an elementwise optimizer "
                          "(SGD, Adam or AdamW)")
    if wait_in_backward:
        raise UsbyteError("sharded mode: wait_in_backward=True is not supported: the averaged "
                          "gradients exist only as shards, never whole in p.grad")
    if compiled:
        raise UsbyteError("sharded mode: a torch.compile'd model is not supported yet")


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
        self.stage: list[torch.Tensor | None] = []
        self.rs_out: list[torch.Tensor] = []
        self.pshard: list[torch.Tensor] = []
        #: This rank's pieces: (block, tensor, start, end), flat-buffer coordinates.
        self.pieces: list[tuple[int, int, int, int]] = []
        #: Per piece, its shard parameter (None: the tensor is not in the optimizer).
        self.shard_params: list[torch.nn.Parameter | None] = []
        by_group: list[list[tuple[torch.nn.Parameter, int, torch.Tensor]]] = [
            [] for _ in optimizer.param_groups]
        for k, blk in enumerate(schedule.blocks):
            view = grads.block_views[k]
            flat = grads.flats[blk.buffer]
            lo = int(view.storage_offset() - flat.storage_offset())
            n = view.numel()
            s = -(-n // ws)
            self.lo.append(lo)
            self.length.append(n)
            self.size.append(s)
            self.buffer.append(blk.buffer)
            self.stage.append(None if s * ws == n else
                              torch.zeros(s * ws, dtype=view.dtype, device=view.device))
            out = torch.zeros(s, dtype=view.dtype, device=view.device)
            ps = torch.zeros(s, dtype=view.dtype, device=view.device)
            self.rs_out.append(out)
            self.pshard.append(ps)
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
        #: Staged blocks gathered but not yet copied into the flat buffer.
        self.unstaged = [False] * len(self.stage)
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
        view, stage = self.grads.block_views[k], self.stage[k]
        if stage is not None:
            stage[:view.numel()].copy_(view)
            view = stage
        return self._rs(self.rs_out[k], view)

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
        all-gathers of the parameters; returns their works, one per block (the pending
        updates of :class:`GatherBack`). ``zeroed``: ``zero_grad(set_to_none=False)`` ran
        after backward."""
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
                self.opt.step()
        finally:
            for grp, params in zip(groups, saved):
                grp["params"] = params
            for members in self.by_group:
                for sp, _, _ in members:
                    sp.grad = None
        views = self.grads.block_views
        works: list[dist.Work | None] = []
        for k in range(len(self.pshard)):
            dst = self.stage[k]
            works.append(self._ag(views[k] if dst is None else dst, self.pshard[k]))
        self.unstaged = [dst is not None for dst in self.stage]
        return works

    def what(self, k: int) -> str:
        return f"all-gather of block {k}'s parameters"

    def copy_back(self, ts: Sequence[int]) -> None:
        """Tensors ``ts``, whose blocks' all-gathers have finished: their gathered values (in
        the flat buffer, out of a staging tensor first) into the parameters."""
        g = self.grads
        with torch.no_grad():
            for t in ts:
                for k in g.tensor_blocks[t]:
                    if self.unstaged[k]:
                        stage = self.stage[k]
                        assert stage is not None
                        g.block_views[k].copy_(stage[:self.length[k]])
                        self.unstaged[k] = False
                g.params[t].copy_(g.views[t])

    # -- state dicts -------------------------------------------------------------------------

    def _plain(self) -> torch.optim.Optimizer:
        """An unsharded optimizer of the same class over the original parameters, with the
        current hyperparameters (no state)."""
        groups = [{**{k: v for k, v in grp.items() if k != "params"}, "params": ps}
                  for grp, ps in zip(self.opt.param_groups, self.orig_params)]
        return type(self.opt)(groups)  # type: ignore[call-arg]  # SGD, Adam, AdamW: lr has a default

    def full_state(self) -> dict[str, Any]:
        """The full state dict, as an unsharded optimizer over the original parameters would
        give it, gathered from every rank's shards (a collective: every rank calls it)."""
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
            flat = torch.zeros(g.flats[b].numel(), dtype=dtype, device=g.flats[b].device)
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
        self.opt.state.clear()
        for grp, ps in zip(self.opt.param_groups, self.orig_params):
            grp["params"] = ps

    # -- checks --------------------------------------------------------------------------

    def coverage(self) -> list[tuple[int, int, int]]:
        """This rank's pieces as (buffer, start, end) in flat-buffer coordinates."""
        return [(self.buffer[k], a, e) for k, _, a, e in self.pieces]

    def require(self, what: str) -> None:
        raise UsbyteError(f"{what} is not supported in sharded mode: the averaged gradients "
                          "exist only as shards")
