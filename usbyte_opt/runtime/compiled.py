"""``torch.compile``: the compiled forward split at the plan's blocks.

A compiled backward is one autograd node per graph: every gradient of a graph becomes ready
when that node's backward ends, so without more, no block of a compiled model could leave
before backward is over. Torch's DDP meets the same problem with its ``DDPOptimizer``
(``torch._dynamo.config.optimize_ddp``, on by default): while a forward through DDP runs,
dynamo splits each graph it compiles at the boundaries of DDP's buckets and compiles each
piece separately, so that each piece's backward hands its gradients on. The runtime uses the
same hook for its own plan:

* **Pieces.** While a runtime is installed, dynamo sees a marker as the active DDP module
  whenever no DDP forward runs (torch's DDP puts its own in place for its forward and the
  marker back after), and the runtime's splitter takes ``DDPOptimizer``'s place for it. The
  splitter finds the installed schedule by the graph's parameters and cuts the graph where
  the plan's blocks end: in forward order, a new piece starts at the first use of a tensor
  held by other blocks than the tensors before it (:func:`plan_pieces`: the first and the
  last block holding it) and keeps the nodes after that use up to the next such one (a
  layer's activation and pooling stay with the layer: fused there, and what crosses the cut
  is the smaller tensor after them; cut before them instead, a lab-cnn cut cost 16–26 ms of
  an iteration of about 80 ms under inductor on two CPU cores), so a block goes out when
  the piece holding its last tensor has run its backward, and the next forward's gates wait
  between pieces for the blocks each reads. A schedule planned on a compiled profile says
  where a cut pays (``cut_pieces``: a cut costs compute, and the planner keeps only the cuts
  worth their cost, :mod:`usbyte_opt.planning.compiled`); the other pieces join the piece
  before them (:func:`merged_pieces`). Each piece is compiled by the user's own backend
  (inductor, ``aot_eager``, ...), exactly as ``DDPOptimizer`` compiles its pieces; a graph
  that reads no planned tensor goes to the backend whole, as without DDP.
* **Gates.** Before each piece the split graph calls :func:`_gate` with the parameters the
  piece reads first: in overlap mode their pending updates run there (or, sharded, their
  all-gathers finish), so the updates of one step overlap the next compiled forward as they
  overlap an eager one. The root pre-hook (eager, before the compiled call) leaves the
  updates of every tensor a split graph gates pending, and applies the others. Where a graph
  of the model was compiled without the runtime's gates (by torch's DDP over the same module,
  or a graph the splitter could not cut, which it says once), the pre-hook applies every
  pending update before the forward, as it does for a model whose training forward runs as
  several graphs (a graph break: eager code between them could read a parameter before a
  later graph's gate); a training forward in which no gate ran while updates
  were left to the gates raises (:func:`check_forward`; every rank runs the same graphs). Torch's DDP run
  compiled first (the wrapper's first iteration) leaves its split in dynamo's cache: the
  runtime drops the compiled code once when it takes over, and the next forward compiles
  the plan's split.
* **Backends that fuse.** Pieces compiled apart compute exactly what the whole graph
  computes under ``aot_eager`` and ``eager`` (:data:`BITWISE_BACKENDS`); under inductor a
  kernel fused across a cut could round apart from compiled torch DDP's. There, unless the
  runtime is given ``accept_compiled_rounding=True``, each graph is compiled exactly as
  compiled torch DDP compiles it (dynamo's own ``DDPOptimizer`` at DDP's buckets,
  :func:`ddp_buckets`), without gates, and every rank says so once; torch DDP's graphs of
  the wrapper's first iteration are those and serve on.

``split_available()`` says whether this torch has the hook; without it a compiled model
trains correctly with every gradient ready at the end of its graph's backward (one line
says so, once).

Example (one process, no communication; the split graph's pieces)::

    >>> import torch
    >>> from usbyte_opt.runtime.compiled import split_available
    >>> split_available()
    True
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import operator
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ..env import COMPILED_ROUNDING_ENV
from ..errors import UsbyteError
from ..planning.compiled import merged_pieces, plan_pieces
from .default_plan import uncompiled

__all__ = ["PlanSplit", "merged_pieces", "own_forward", "plan_pieces", "split_available"]


class _ModelState:
    """What the splitter learnt about one model's compiled graphs."""

    __slots__ = ("gated", "covered", "foreign", "gates_run", "graphs_run", "multi", "pieces",
                 "key", "resplits", "at_ddp_buckets")

    def __init__(self) -> None:
        #: Graphs compiled split with gates, and their pieces in all.
        self.gated = 0
        self.pieces = 0
        #: ids of the parameters some gated graph gates.
        self.covered: set[int] = set()
        #: A graph of this model compiled without the runtime's gates (torch's DDP over the
        #: same module), or one the splitter could not gate: every update runs before the
        #: forward from then on.
        self.foreign = False
        #: Gates run in the forward in progress, and the graphs they belong to.
        self.gates_run = 0
        self.graphs_run: set[int] = set()
        #: A training forward ran as several split graphs, or a graph resumed after a graph
        #: break: eager code before a graph could read a parameter whose update its gate
        #: would run, so every update runs before the forward from then on.
        self.multi = False
        #: The pieces the gated graphs were split into (:attr:`PlanSplit.key`), and how many
        #: times the compiled code was dropped for another plan's pieces.
        self.key: tuple[int, ...] | None = None
        self.resplits = 0
        #: Graphs compiled at DDP's buckets instead of the plan's pieces (a backend that may
        #: round the plan's pieces apart, :data:`BITWISE_BACKENDS`), no gates.
        self.at_ddp_buckets = 0

    def at_ddp_buckets_for(self, backend: str) -> None:
        """A graph runs compiled at DDP's buckets (under ``backend``, which could round the
        plan's pieces apart): no gates, so every update runs before the forward; every rank
        says so once."""
        self.foreign = True
        self.at_ddp_buckets += 1
        _say_once(_at_ddp_buckets_line(backend))

    def drop_graphs(self) -> None:
        """Drop dynamo's compiled code (every model's: dynamo keeps it per code object), so
        that the next forward compiles the graphs again, split for the plan registered then."""
        import torch._dynamo

        torch._dynamo.reset_code_caches()
        self.resplits += 1
        self.gated = self.pieces = 0
        self.covered = set()
        self.foreign = False
        self.key = None
        self.at_ddp_buckets = 0


_STATES: weakref.WeakKeyDictionary[torch.nn.Module, _ModelState] = weakref.WeakKeyDictionary()
#: id(parameter) -> (split, runtime index) of the schedule installed now.
_OWNERS: dict[int, tuple[PlanSplit, int]] = {}
#: The splits registered now.
_LIVE: weakref.WeakSet[PlanSplit] = weakref.WeakSet()
#: Modules whose graphs torch's DDP compiled (its DDPOptimizer's split, no gates), with the
#: backend's name.
_COMPILED_BY_DDP: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
#: The model's DDP bucket size in bytes (the wrapper's ``bucket_cap_mb``), where a graph is
#: compiled at DDP's buckets (:func:`ddp_buckets`); DDP's default elsewhere.
_DDP_BUCKET_BYTES: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
#: Dynamo's own ``DDPOptimizer`` class, once patched.
_ORIGINAL: list[Any] = []


class _Marker:
    """What dynamo sees as the active DDP module while a runtime is installed and no DDP
    forward runs: its DDP hook then asks the runtime's splitter (:func:`_patch`'s
    dispatcher), which splits the graphs that read a registered split's tensors and hands
    every other graph to the backend as it is (as without any DDP)."""

    #: Read by dynamo's DDP hook (``DDPOptimizer(bucket_bytes_cap=...)``); the plan decides.
    bucket_bytes_cap = 1 << 62

    def __repr__(self) -> str:
        return "<usbyte-opt: compiled graphs split at the plan's blocks>"


_MARKER = _Marker()


def watch() -> None:
    """Note from now on when torch's DDP compiles a model (patching dynamo's ``DDPOptimizer``,
    now or when dynamo is imported), without taking dynamo's DDP hook for the runtime: the
    wrapper calls this when it starts on torch's DDP and hands over to the runtime at the
    optimizer's first step, so that the runtime then drops torch DDP's split once
    (:meth:`PlanSplit.register`) and compiles the plan's."""
    if not _HOOKED and not _WAITING:
        _hook_when_loaded()


def arm() -> None:
    """Dynamo's DDP hook asks the runtime from now on: the marker is the active DDP module
    (no DDP forward runs: torch's DDP sets its own for its forward and ``None`` after it, so
    :func:`rearm` sets the marker again at each ``step()``), and ``DDPOptimizer`` is the
    runtime's dispatcher once dynamo's module is loaded (now, or when it is imported)."""
    if DDP._active_ddp_module is None:
        DDP._active_ddp_module = _MARKER  # type: ignore[assignment]
    if not _HOOKED and not _WAITING:
        _hook_when_loaded()


def rearm() -> None:
    """:func:`arm` again while a runtime is installed (each ``step()``): a torch DDP forward
    of another model puts ``None`` back as the active DDP module when it ends."""
    if _LIVE:
        arm()


def disarm() -> None:
    """No runtime is installed any more: dynamo's DDP hook is torch's alone again."""
    if DDP._active_ddp_module is _MARKER:
        DDP._active_ddp_module = None


class PlanSplit:
    """One installed schedule's split: the piece of each trainable tensor, and the gates'
    way into its pending updates (:meth:`register`; the splitter finds it by the graph's
    parameters).

    Args:
        model: the module trained.
        params: the trainable tensors, by runtime index.
        pieces: each tensor's piece (:func:`plan_pieces`).
        gate: runs the pending updates of the runtime indices given (the forward gates').
        accept_rounding: compile the plan's pieces under any backend; else, under a backend
            that may round them apart from compiled DDP's (:data:`BITWISE_BACKENDS`), the
            graphs are compiled at DDP's buckets (exactly as compiled torch DDP's), without
            gates.
    """

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                 pieces: Sequence[int], gate: Callable[[list[int]], None],
                 accept_rounding: bool = False):
        self.model = model
        self.accept_rounding = accept_rounding
        self.params = list(params)
        self.piece_of = {id(p): pieces[t] for t, p in enumerate(self.params)}
        self.run_gate = gate
        self.state = _STATES.setdefault(model, _ModelState())
        self._split_cache: tuple[int, list[int], list[int]] | None = None
        #: The plan's pieces, by the model's tensors (the compiled split's identity).
        self.key = tuple(pieces)

    # -- installation ------------------------------------------------------------------------

    def register(self, resplit: bool = True) -> None:
        """The gates of every split graph of the model reach this schedule's updates, and
        dynamo's DDP hook is the runtime's from now on (:func:`arm`).

        Graphs split for another plan's pieces are compiled again for this one's when
        ``resplit``: a runtime's first schedule, not the tuner's switches between the plan
        and DDP's buckets while it verifies (a compile per window would cost more than any
        plan wins; the windows share the split compiled first, and the schedule the tuner
        settles on gets its own then, :meth:`settle`). Graphs torch's DDP compiled (its
        first iteration under the wrapper) are always compiled again."""
        for t, p in enumerate(self.params):
            _OWNERS[id(p)] = (self, t)
        _LIVE.add(self)
        arm()
        by_ddp = _COMPILED_BY_DDP.get(self.model)
        if by_ddp is not None and not self.accept_rounding and by_ddp not in BITWISE_BACKENDS:
            # Torch's DDP compiled the model under a backend that may round the plan's pieces
            # apart: its graphs, at DDP's buckets, are what the runtime would compile (no
            # compilation more).
            del _COMPILED_BY_DDP[self.model]
            self.state.at_ddp_buckets_for(by_ddp)
        elif by_ddp is not None or (resplit and self._stale()):
            # Torch's DDP ran this model compiled first (the wrapper's first iteration), or
            # the graphs were split for another plan's pieces (``auto``'s switch from DDP's
            # buckets to its plan, a replan): dynamo's cache would hand that split to this
            # plan. Compiled code is dropped, so the next forward compiles this plan's split
            # (one compilation more, as torch's DDP's first iteration costs one).
            _COMPILED_BY_DDP.pop(self.model, None)
            self.state.drop_graphs()

    def settle(self, torch_ddp: bool) -> None:
        """The tuner settled for good. On this schedule (``torch_ddp`` false): graphs split
        for another schedule's pieces (the one verification began with) are compiled again
        for this one's. On torch's DDP (verification's verdict, or ``auto`` failing): graphs
        split at a plan's pieces are dropped, so that torch's DDP compiles its own split
        (``DDPOptimizer``'s, at its buckets) at the next forward, as in a run that never had
        a plan (dynamo keeps one split per graph: without this, DDP would go on running the
        plan's)."""
        if (torch_ddp and self.state.key is not None) or self._stale():
            self.state.drop_graphs()

    def _stale(self) -> bool:
        """Whether the model's graphs were split for another plan's pieces."""
        return self.state.key is not None and self.state.key != self.key

    def unregister(self) -> None:
        for p in self.params:
            if _OWNERS.get(id(p), (None,))[0] is self:
                del _OWNERS[id(p)]
        _LIVE.discard(self)
        if not _LIVE:
            disarm()

    def enter(self) -> None:
        """A forward of the model starts (eagerly): its gates are counted from here."""
        self.state.gates_run = 0
        self.state.graphs_run.clear()
        arm()

    @property
    def gated(self) -> bool:
        """Whether the model's compiled graphs gate the updates they read (else every update
        runs before the forward)."""
        st = self.state
        return st.gated > 0 and not st.foreign and not st.multi

    def gated_and_rest(self) -> tuple[list[int], list[int]]:
        """The runtime indices some gated graph gates, and the others (kept until a graph is
        compiled again)."""
        key = len(self.state.covered)
        if self._split_cache is None or self._split_cache[0] != key:
            cov = self.state.covered
            ids = [id(p) in cov for p in self.params]
            self._split_cache = (key, [t for t, c in enumerate(ids) if c],
                                 [t for t, c in enumerate(ids) if not c])
        return self._split_cache[1], self._split_cache[2]


def _gate(graph: int, *params: torch.Tensor) -> None:
    """Called by split graph ``graph`` before each piece, with the parameters the piece reads
    first: their pending updates run now (nothing when none is pending)."""
    by: dict[int, tuple[PlanSplit, list[int]]] = {}
    for p in params:
        owner = _OWNERS.get(id(p))
        if owner is not None:
            split, t = owner
            by.setdefault(id(split), (split, []))[1].append(t)
    for split, ts in by.values():
        split.state.gates_run += 1
        split.state.graphs_run.add(graph)
        split.run_gate(ts)


_GRAPH_IDS = iter(range(1 << 62))


# -- the splitter ------------------------------------------------------------------------------

class _Splitter:
    """Takes ``DDPOptimizer``'s place while the marker is the active DDP module: splits a
    graph that reads the tensors of a registered split, and hands any other to the backend."""

    def __init__(self, backend_compile_fn: Callable[..., Any]):
        self.backend = backend_compile_fn

    def compile_fn(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kw: Any) -> Any:
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        inputs: dict[torch.fx.Node, torch.Tensor] = {}
        votes: dict[int, tuple[PlanSplit, int]] = {}
        for i, n in enumerate(placeholders):
            ga = n.meta.get("grapharg")
            ex = getattr(ga, "example", None) if ga is not None else None
            if ex is None and i < len(example_inputs):
                ex = example_inputs[i]
            owner = _OWNERS.get(id(ex)) if isinstance(ex, torch.Tensor) else None
            if owner is not None:
                inputs[n] = ex  # type: ignore[assignment]
                sp, c = votes.get(id(owner[0]), (owner[0], 0))
                votes[id(sp)] = (sp, c + 1)
        if not votes:
            return self.backend(gm, example_inputs, **kw)
        # (One model per graph in practice; two runtimes' models in one graph: the one with
        # more tensors there splits it.)
        split = max(votes.values(), key=lambda v: v[1])[0]
        state, piece_of = split.state, split.piece_of
        real = {n: p for n, p in inputs.items() if id(p) in piece_of}
        body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
        if _reads_plan_tensors_otherwise(gm, body, piece_of):
            # A module call or an attribute read the gates cannot see: split nothing, and
            # every update runs before the forward.
            state.foreign = True
            return self.backend(gm, example_inputs, **kw)
        if not real:
            return self.backend(gm, example_inputs, **kw)
        name = _backend_name(self.backend)
        if name not in BITWISE_BACKENDS and not split.accept_rounding:
            # The plan's pieces could round apart from compiled DDP's: the graph is compiled
            # exactly as compiled torch DDP compiles it (DDPOptimizer at DDP's buckets), so
            # blocks leave as DDP's pieces end, and updates run before the forward.
            state.at_ddp_buckets_for(name)
            cap = _DDP_BUCKET_BYTES.get(split.model, DEFAULT_BUCKET_BYTES)
            return _ORIGINAL[0](cap, self.backend).compile_fn(gm, example_inputs, **kw)
        first: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        seen: set[torch.fx.Node] = set()
        for n in body:
            for a in n.all_input_nodes:
                if a in real and a not in seen:
                    seen.add(a)
                    first.setdefault(n, []).append(a)
        # In forward order: a new piece starts at the first use of a tensor of another piece
        # (its gate just before that use), and holds every node up to the next such use, so
        # what follows a layer's first use (its activation, a pooling) stays with it: fused
        # there, and its output handed on where it is smallest.
        part: dict[torch.fx.Node, int] = {}
        level, cur = -1, 0
        for n in body:
            # (A node reading tensors of several pieces first, a layer's weight and bias in
            # two blocks, goes with the piece wanted first: its backward yields them together.)
            want = min((piece_of[id(real[a])] for a in first.get(n, ())), default=-1)
            if want >= 0 and want != level:
                if level >= 0:
                    cur += 1
                level = want
            part[n] = cur
        part, last = _live_pieces(body, part)
        for n in body:
            # An item of a tuple-valued node stays in that node's piece: a piece hands on
            # tensors, not tuples (nn.MultiheadAttention's (output, weights), for one).
            if n.op == "call_function" and n.target is operator.getitem:
                src = n.args[0]
                if isinstance(src, torch.fx.Node) and src in part:
                    part[n] = part[src]
        gates_of: dict[int, list[torch.fx.Node]] = {}
        for n, args in first.items():
            gates_of.setdefault(part[n], []).extend(args)
        if _after_graph_break():
            # Eager code ran before this graph in the same forward and could read a
            # parameter before this graph's gate: the updates run before the forward.
            state.multi = True
        try:
            split_gm = _split(gm, part, self.backend, example_inputs, kw)
        except Exception as e:  # noqa: BLE001 - the graph as it is, every update before it
            state.foreign = True
            _say_once(f"usbyte-opt: torch.compile: a graph of {type(split.model).__name__} "
                      f"could not be split at the plan's blocks ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); it runs whole, its "
                      "gradients ready at the end of its backward")
            return self.backend(gm, example_inputs, **kw)
        graph_id = next(_GRAPH_IDS)
        by_name = {n.name: n for n in split_gm.graph.nodes if n.op == "placeholder"}
        g = split_gm.graph
        for n in list(g.nodes):
            if n.op == "call_module" and str(n.target).startswith(("compiled_submod_", "submod_")):
                j = int(str(n.target).rsplit("_", 1)[1])
                reads = tuple(by_name[a.name] for a in gates_of.get(j, ()) if a.name in by_name)
                if reads:
                    with g.inserting_before(n):
                        g.call_function(_gate, (graph_id, *reads))
        split_gm.recompile()
        if name not in BITWISE_BACKENDS and last > 0:
            _say_once(f"usbyte-opt: torch.compile ({name}): the plan's pieces are compiled "
                      "apart (accept_compiled_rounding), so a fused kernel can round "
                      "differently from compiled torch DDP's pieces at its buckets, as another "
                      "bucket size would")
        state.gated += 1
        state.pieces += last + 1
        state.key = split.key
        state.covered.update(id(t) for t in real.values())
        return split_gm


#: Backends under which the pieces compute exactly what the whole graph and DDPOptimizer's
#: pieces compute (no fusion across a cut to lose or gain).
BITWISE_BACKENDS = ("aot_eager", "eager")


def _at_ddp_buckets_line(backend: str) -> str:
    return (f"usbyte-opt: torch.compile ({backend}): compiled at DDP's buckets as compiled "
            f"torch DDP is, not at the plan's pieces, which {backend} could round apart from "
            "DDP's; blocks leave as DDP's pieces end, updates run before the forward "
            f"(accept_compiled_rounding=True or {COMPILED_ROUNDING_ENV}=1: the plan's pieces; "
            "under aot_eager they are bitwise)")


def ddp_buckets(model: torch.nn.Module, bucket_cap_mb: float | None) -> None:
    """The DDP bucket size ``model`` would have under torch's DDP (the wrapper's
    ``bucket_cap_mb``; ``None``: DDP's default): the size its graphs are compiled at where
    the plan's pieces could round apart (:class:`PlanSplit`'s ``accept_rounding``)."""
    orig = uncompiled(model)
    if bucket_cap_mb is None:
        _DDP_BUCKET_BYTES.pop(orig, None)
    else:
        _DDP_BUCKET_BYTES[orig] = int(bucket_cap_mb * 1024 * 1024)


def _backend_name(backend: Any) -> str:
    """The user's backend by name (``inductor``, ``aot_eager``, ...)."""
    for attr in ("compiler_name", "__name__"):
        v = getattr(backend, attr, None)
        if isinstance(v, str):
            return v
    return type(backend).__name__


def _after_graph_break() -> bool:
    """Whether the graph being compiled resumes a frame after a graph break (dynamo names
    such frames ``torch_dynamo_resume_in_...``): eager code ran before it."""
    from torch._guards import TracingContext

    tc = TracingContext.try_get()
    codes = getattr(tc, "traced_code", None) or []
    return bool(codes) and codes[0].co_name.startswith("torch_dynamo_resume_in")


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    """One line on stderr, once per process."""
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)


def _live_pieces(body: list[torch.fx.Node], part: dict[torch.fx.Node, int]
                 ) -> tuple[dict[torch.fx.Node, int], int]:
    """``part`` with every piece that hands nothing on (no node of it read by another piece
    or the graph's output: it would be dead, DDPOptimizer's rule too) joined to the piece
    before it (the first to the one after), numbered again from 0; and the last number."""
    while True:
        ids = sorted(set(part.values()))
        hands_on = {k: False for k in ids}
        for n in body:
            if any(part.get(u, -1) != part[n] for u in n.users):
                hands_on[part[n]] = True
        dead = [k for k in ids if not hands_on[k]]
        if not dead or len(ids) == 1:
            break
        k = dead[0]
        i = ids.index(k)
        into = ids[i - 1] if i > 0 else ids[i + 1]
        part = {n: into if p == k else p for n, p in part.items()}
    renum = {k: j for j, k in enumerate(sorted(set(part.values())))}
    return {n: renum[p] for n, p in part.items()}, len(renum) - 1


def _reads_plan_tensors_otherwise(gm: torch.fx.GraphModule, body: list[torch.fx.Node],
                                  piece_of: dict[int, int]) -> bool:
    """Whether the graph reads a planned tensor other than as an input (a module call or an
    attribute of the graph module)."""
    for n in body:
        if n.op == "get_attr":
            v = getattr(gm, str(n.target), None)
            if isinstance(v, torch.Tensor) and id(v) in piece_of:
                return True
        elif n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            if any(id(p) in piece_of for p in mod.parameters()):
                return True
    return False


def _split(gm: torch.fx.GraphModule, part: dict[torch.fx.Node, int],
           backend: Callable[..., Any], example_inputs: list[Any], kw: dict) -> Any:
    """The graph cut into ``part``'s pieces, each compiled by ``backend`` (as DDPOptimizer
    compiles its pieces)."""
    from torch._dynamo.backends import distributed as tdd
    from torch._dynamo.utils import detect_fake_mode
    from torch.fx.passes.split_module import split_module

    split_gm = split_module(gm, None, lambda n: part[n])  # type: ignore[arg-type]
    tdd.propagate_dynamo_source(gm, split_gm)
    tdd.propagate_metadata(gm, split_gm)
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    compiler = tdd.SubmodCompiler(split_gm, backend, fake_mode, **kw)
    with torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing():
        compiler.run(*example_inputs)
    return split_gm


def own_forward(model: torch.nn.Module) -> None:
    """Give ``model`` a forward of its own code object (the same function, copied): dynamo
    keeps its compiled graphs per code object, so models of one class compiled side by side
    in one process (``bench --compile``'s trainees, the profile's twin) would otherwise share
    the graphs of whichever compiled first (torch DDP's split at its buckets, or the
    runtime's at its plan), which separate runs do not.

    Example::

        >>> m = torch.nn.Linear(2, 2)
        >>> own_forward(m)
        >>> m.forward.__code__ is torch.nn.Linear.forward.__code__, m(torch.ones(1, 2)).shape
        (False, torch.Size([1, 2]))
    """
    import types

    f = type(model).forward
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                           f.__closure__)
    g.__kwdefaults__, g.__qualname__ = f.__kwdefaults__, f.__qualname__
    model.forward = types.MethodType(g, model)  # type: ignore[method-assign]


# -- dynamo's hook ------------------------------------------------------------------------------

_HOOKED: list[bool] = []
#: The import hook waits for dynamo's module (nothing to look at again at each step).
_WAITING: list[bool] = []
_TARGET = "torch._dynamo.backends.distributed"


def split_available() -> bool:
    """Whether this torch lets the runtime split compiled graphs (dynamo's DDP hook and the
    pieces' compiler are present)."""
    try:
        from torch._dynamo.backends import distributed as tdd
        from torch.fx.passes.split_module import split_module  # noqa: F401
    except ImportError:
        return False
    return all(hasattr(tdd, a) for a in ("DDPOptimizer", "SubmodCompiler", "propagate_metadata",
                                         "propagate_dynamo_source"))


def _hook_when_loaded() -> None:
    """Patch dynamo's ``DDPOptimizer`` now if dynamo's module is loaded (``torch.compile``
    loads it), else when it is imported: importing dynamo costs seconds, which a run that
    compiles nothing does not pay."""
    mod = sys.modules.get(_TARGET)
    if mod is not None:
        _patch(mod)
    else:
        if not any(isinstance(f, _OnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _OnImport())
        _WAITING.append(True)


class _OnImport(importlib.abc.MetaPathFinder):
    """Patches dynamo's DDP module right after it is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch(tdd: Any) -> None:
    """Put the runtime's dispatcher in ``DDPOptimizer``'s place (once): with the marker active
    it returns the runtime's splitter; torch's DDP keeps ``DDPOptimizer`` itself."""
    if _HOOKED:
        return
    if not split_available():
        _HOOKED.append(False)
        _say_once(f"usbyte-opt: torch.compile: this torch ({torch.__version__}) has no DDP hook "
                  "in dynamo: compiled graphs run whole, their gradients ready at the end of "
                  "each graph's backward")
        return
    original = tdd.DDPOptimizer
    _ORIGINAL.append(original)

    def dispatch(bucket_bytes_cap: int, backend_compile_fn: Callable[..., Any],
                 first_bucket_cap: int | None = None) -> Any:
        active = DDP._get_active_ddp_module()
        if active is _MARKER:
            return _Splitter(backend_compile_fn)
        module = getattr(active, "module", None)
        if isinstance(module, torch.nn.Module):
            module = uncompiled(module)
            # Torch's DDP compiles the model's graphs its own way (and dynamo's cache would
            # hand them to the runtime): noted, for the runtime to start afresh (register).
            _COMPILED_BY_DDP[module] = _backend_name(backend_compile_fn)
            st = _STATES.get(module)
            if st is not None:
                st.foreign = True
        return original(bucket_bytes_cap, backend_compile_fn, first_bucket_cap)

    dispatch._usbyte_original = original  # type: ignore[attr-defined]
    tdd.DDPOptimizer = dispatch
    _HOOKED.append(True)


def check_forward(split: PlanSplit, training: bool, pending_before: int,
                  pending_now: int) -> None:
    """After a compiled forward (eagerly): a training forward that ran several split graphs,
    or one after a graph break, makes every later forward run its updates first
    (:attr:`_ModelState.multi`).
    Raises where this forward had left updates to the gates and either no gate ran (a graph
    without gates ran, on parameters not yet updated) or the forward broke into several
    graphs (eager code between them may have read a parameter before its gate)."""
    st = split.state
    if training and len(st.graphs_run) > 1:
        st.multi = True
    if training and st.multi and pending_before:
        # (Updates are left to the gates only while the model is not known to break.)
        raise UsbyteError(
                "torch.compile: the compiled forward ran as several graphs (a graph break) "
                "after earlier forwards had run as one, while updates were left to its gates: "
                "code between the graphs may have read parameters not yet updated; make the "
                "graph break happen from the first iteration (or remove it), or train in "
                "fence mode")
    if pending_before and st.gates_run == 0 and pending_now == pending_before:
        st.foreign = True
        raise UsbyteError("torch.compile: the compiled forward ran a graph that usbyte-opt did "
                          "not split (compiled outside the runtime's forward?), on parameters "
                          "whose update was pending; compile the model before wrapping it, "
                          "or wrap it and then compile")
