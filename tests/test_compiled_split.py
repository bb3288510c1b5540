"""``torch.compile``: the runtime splits a compiled graph at the plan's blocks.

Two gloo ranks, one run for the slow cases (compiling is the cost; the default suite runs
one case on its own): every case trains compiled
torch DDP (its own DDPOptimizer) and the compiled runtime side by side on the same batches and
compares every parameter and buffer bitwise, and reads what the split did:

* **readiness**: the autograd graph of a training loss, walked from the loss: the compiled
  pieces' backward nodes, and for each trainable tensor the piece whose backward hands its
  gradient on; and in a real backward, a logical clock (the pieces' backward nodes count
  themselves as they start) read by each tensor's gradient hook. Unsplit, every gradient
  of a graph comes from one node, at the end of its backward;
* **gates**: the pending updates the split graph's gates ran (overlap and sharded modes);
* **recompiles**: dynamo's compile count after the first iterations does not grow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn
from test_runtime_equivalence import TinyGPT, max_diff, problem_of, sched_two_phase, twins
from torch.nn.parallel import DistributedDataParallel as DDP

from usbyte_opt.formats import Block, Mode, Schedule
from usbyte_opt.launcher import run_local

STEPS = 5


class Deep(nn.Module):
    """8 Linear+ReLU layers; ``brk``: a graph break after the fourth."""

    def __init__(self, d: int = 64, brk: bool = False):
        super().__init__()
        self.a = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(d, d), nn.ReLU())])
        self.b = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(d, d), nn.ReLU())])
        self.norm = nn.BatchNorm1d(d)
        self.brk = brk

    def forward(self, x):
        h = self.a(x)
        if self.brk:
            torch._dynamo.graph_break()
        return self.b(self.norm(h))


@torch._dynamo.disable
def _eager_scale(w: torch.Tensor) -> torch.Tensor:
    """Runs eagerly inside a compiled forward (a graph break): reads a weight."""
    return w.mean() * 0.01


class DeepEager(Deep):
    """Eager code between two graphs reads a weight the second graph reads too: it must see
    the weight's update, as under DDP. (On gloo every block is complete by the first gate,
    which then runs every update: equality alone would not tell; the model is flagged as
    breaking, and its updates run before the forward.)"""

    def forward(self, x):
        h = self.a(x)
        s = _eager_scale(self.b[0].weight)
        return self.b(self.norm(h)) * (1 + s)


def grouped(model: nn.Module, ws: int, per: int, mode: Mode = Mode.OVERLAP) -> Schedule:
    """Whole tensors in ready order, ``per`` tensors to a block."""
    pb = problem_of(model, ws)
    lay = pb.layout()
    order = list(pb.ready_order())
    blocks = []
    for i in range(0, len(order), per):
        parts = [lay.whole(j) for j in order[i:i + per]]
        if len({b.buffer for b in parts}) == 1 and max(b.end for b in parts) - min(
                b.start for b in parts) == sum(b.end - b.start for b in parts):
            blocks.append(Block(parts[0].buffer, min(b.start for b in parts),
                                max(b.end for b in parts)))
        else:
            blocks += parts
    return pb.schedule(f"grouped-{per}", lay, blocks, mode=mode)


def readiness(model: nn.Module, loss: torch.Tensor) -> dict:
    """The compiled pieces' backward nodes and the piece handing on each tensor's gradient
    (walked from ``loss``); then ``loss.backward()`` with a logical clock: each piece's
    backward node counts itself as it starts, each gradient hook reads the count."""
    params = {id(p): i for i, p in enumerate(model.parameters())}
    piece_of: dict[int, int] = {}
    nodes: list = []
    seen: set = set()
    stack = [(loss.grad_fn, None)]
    while stack:
        fn, piece = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "CompiledFunction" in type(fn).__name__:
            piece = len(nodes)
            nodes.append(fn)
        var = getattr(fn, "variable", None)
        if var is not None and id(var) in params:
            piece_of.setdefault(params[id(var)], piece if piece is not None else -1)
        stack.extend((nf, piece) for nf, _ in fn.next_functions)
    clock = [0]
    for fn in nodes:
        fn.register_prehook(lambda g, c=clock: (c.__setitem__(0, c[0] + 1), None)[1])
    when: dict[int, int] = {}
    hs = [p.register_post_accumulate_grad_hook(
        lambda t, i=i: (when.setdefault(i, clock[0]), None)[1])
        for i, p in enumerate(model.parameters())]
    loss.backward()
    for h in hs:
        h.remove()
    return {"pieces": len(nodes), "groups": len(set(piece_of.values())),
            "clock_groups": len(set(when.values())), "clock_end": clock[0],
            "first_ready_at": min(when.values()) if when else -1}


def _batch(model: nn.Module, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    if isinstance(model, TinyGPT):
        return torch.randint(0, 40, (16, 8), generator=g), torch.randn(16, 8, 40, generator=g)
    d = model.a[0].in_features
    return torch.randn(16, d, generator=g), torch.randn(16, d, generator=g)


def _train(rank: int, ws: int, make, sched_of, how: str, backend: Any = "aot_eager",
           loop: str = "plain", **runtime: Any) -> dict:
    """Compiled DDP against the compiled runtime; ``how``: ``opt`` (DistributedOptimizer
    given the compiled module), ``wrap-compiled`` (the wrapper around a compiled module),
    ``compile-wrap`` (``torch.compile`` of the wrapper); ``late-...``: the wrapper given no
    optimizer (DDP's one line), so torch's DDP runs the first iteration compiled (its own
    split) and the runtime takes over at the optimizer's first step. ``runtime``: more
    keywords for the runtime."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import usbyte_opt
    from usbyte_opt.runtime import DistributedOptimizer
    from usbyte_opt.runtime.compiled import _STATES

    ref, mod = twins(make)
    sched = sched_of(mod, ws)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    o_usb = torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9)
    cddp = torch.compile(DDP(ref), backend=backend)
    if how == "opt":
        net = torch.compile(mod, backend=backend)
        o_usb = DistributedOptimizer(o_usb, net, schedule=sched, verify=False, **runtime)
    elif how.endswith("wrap-compiled"):
        given = {} if how.startswith("late-") else {"optimizer": o_usb}
        net = usbyte_opt.DistributedDataParallel(torch.compile(mod, backend=backend),
                                                 schedule=sched, verify=False, **given, **runtime)
    else:
        given = {} if how.startswith("late-") else {"optimizer": o_usb}
        net = torch.compile(usbyte_opt.DistributedDataParallel(mod, schedule=sched,
                                                               verify=False, **given, **runtime),
                            backend=backend)
    compiles: list[int] = []
    info: dict = {}
    # Compiled DDP first, then the runtime: dynamo's cache is per code object, so the two
    # twins (one class) train one after the other on the same batches, the cache reset
    # between them.
    for which, m, o in (("ddp", cddp, o_ref), ("usb", net, o_usb)):
        torch._dynamo.reset()
        for step in range(STEPS):
            x, y = _batch(mod, rank, step)
            if loop == "accum":
                with (o if isinstance(o, DistributedOptimizer) else m).no_sync():
                    (m(x[:8]) - y[:8]).pow(2).mean().backward()
                loss = (m(x[8:]) - y[8:]).pow(2).mean()
            else:
                loss = (m(x) - y).pow(2).mean()
            if which == "usb" and step == STEPS - 1:
                info = readiness(mod, loss)
            else:
                loss.backward()
            if loop == "clip":
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
            if which == "usb":
                compiles.append(int(counters["stats"]["unique_graphs"]))
            if step == 1:   # an eval forward between steps, compiled as well
                with torch.no_grad():
                    m.eval()
                    m(x)
                    m.train()
    rt = o_usb if isinstance(o_usb, DistributedOptimizer) else None
    if rt is None:
        inner = getattr(net, "_orig_mod", net)
        rt = inner._opt
    rt.synchronize()
    st = _STATES.get(mod)
    if sched.cut_pieces is not None and isinstance(mod, Deep):
        # The pieces the merged groups make in forward order (a, the norm, b), as the
        # planner's model walks them: a new piece at each change of group.
        piece_of = rt._state.gates.split.piece_of
        order = [mod.a[i] for i in (0, 2, 4, 6)] + [mod.norm] + [mod.b[i] for i in (0, 2, 4, 6)]
        groups = [min(piece_of[id(p)] for p in m.parameters()) for m in order]
        info["expected_pieces"] = 1 + sum(g != h for g, h in zip(groups, groups[1:]))
    return {"diff": max_diff(ref, mod, buffers=True), "compiles": compiles, **info,
            "gated": st.gated if st else 0, "foreign": st.foreign if st else None,
            "resplits": st.resplits if st else 0,
            "at_ddp_buckets": st.at_ddp_buckets if st else 0,
            "multi": st.multi if st else None,
            "mode": str(rt.mode), "blocks": len(sched.blocks)}


def case_all(rank: int, ws: int) -> dict:
    out = {}
    cases = {
        "opt-overlap": (Deep, lambda m, w: grouped(m, w, 4), "opt", "clip"),
        "wrap-compiled": (Deep, lambda m, w: grouped(m, w, 4), "wrap-compiled", "plain"),
        "compile-wrap": (Deep, lambda m, w: grouped(m, w, 4), "compile-wrap", "plain"),
        "late-compile-wrap": (Deep, lambda m, w: grouped(m, w, 4), "late-compile-wrap", "plain"),
        "fence-accum": (Deep, lambda m, w: grouped(m, w, 4, Mode.FENCE), "opt", "accum"),
        "sharded": (Deep, lambda m, w: grouped(m, w, 4, Mode.SHARDED), "opt", "plain"),
        "graph-break": (lambda: Deep(brk=True), lambda m, w: grouped(m, w, 4), "opt", "plain"),
        "cut-tensors": (Deep, sched_two_phase, "opt", "plain"),
        "tied-lm": (TinyGPT, lambda m, w: grouped(m, w, 3), "opt", "plain"),
        "eager-read": (DeepEager, lambda m, w: grouped(m, w, 4), "opt", "plain"),
        # The planner kept one cut of the plan's four (a schedule's cut_pieces): 2 pieces.
        "cut-pieces": (Deep, lambda m, w: dataclasses.replace(grouped(m, w, 4), cut_pieces=(2,)),
                       "opt", "plain"),
    }
    for name, (make, sched_of, how, loop) in cases.items():
        try:
            out[name] = _train(rank, ws, make, sched_of, how, loop=loop)
        except Exception as e:   # recorded per case: the ranks stay in step
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def case_one(rank: int, ws: int) -> dict:
    return _train(rank, ws, Deep, lambda m, w: grouped(m, w, 4), "late-wrap-compiled", loop="clip")


def case_default(rank: int, ws: int) -> dict:
    """The default suite's two compiled cases in one run (starting ranks costs seconds)."""
    return {"one": case_one(rank, ws), "fusing": case_fusing(rank, ws, False)}


def _values(fn, timeout_s: int, pg_timeout_s: int) -> list[dict]:
    """``fn`` on two ranks: each rank's value, every rank having succeeded."""
    res = run_local(fn, 2, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
    return [r.value for r in res]


@pytest.fixture(scope="module")
def default_cases() -> list[dict]:
    return _values(case_default, 400, 120)


def test_one_compiled_model_trains_as_compiled_ddp_piece_by_piece(default_cases) -> None:
    """The default suite's case (the others are slow: each compiles twice): DDP's one line
    changed around a compiled model (torch's DDP runs the first iteration with its own split,
    which the runtime drops once when it takes over), overlap mode, clipping, an eval forward
    between steps."""
    for per_rank in default_cases:
        v = per_rank["one"]
        assert v["diff"] == 0.0, v
        assert v["pieces"] >= v["blocks"] - 1 and v["clock_groups"] >= v["blocks"] - 1, v
        assert v["first_ready_at"] <= 2 < v["clock_end"], v
        assert v["gated"] >= 1 and not v["foreign"], v
        # Torch DDP's split dropped once at the takeover; no recompile after step 1's eval.
        assert v["resplits"] == 1, v
        c = v["compiles"]
        assert c[2:] == [c[2]] * (len(c) - 2), c


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return _values(case_all, 600, 180)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["opt-overlap", "wrap-compiled", "compile-wrap",
                                  "late-compile-wrap", "fence-accum", "sharded", "graph-break",
                                  "cut-tensors", "tied-lm", "eager-read", "cut-pieces"])
def test_compiled_runtime_trains_as_compiled_ddp(results: list[dict], case: str) -> None:
    for rank, res in enumerate(results):
        r = res[case]
        assert "error" not in r, (rank, r)
        assert r["diff"] == 0.0, (rank, r)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["opt-overlap", "wrap-compiled", "compile-wrap",
                                  "late-compile-wrap", "fence-accum", "sharded"])
def test_gradients_leave_piece_by_piece(results: list[dict], case: str) -> None:
    """4 whole-tensor blocks of 4 tensors over 8 layers: 4 pieces, and the gradients of each
    ready as its piece's backward ends (not all at the end)."""
    for res in results:
        r = res[case]
        assert r["blocks"] == 5, r            # 17 tensors (8 layers and the norm), 4 per block
        assert r["pieces"] >= r["blocks"] - 1, r
        assert r["groups"] >= r["blocks"] - 1, r
        assert r["clock_groups"] >= r["blocks"] - 1, r
        assert r["first_ready_at"] <= 2 < r["clock_end"], r
        assert r["gated"] >= 1 and not r["foreign"], r


@pytest.mark.slow
def test_no_recompiles_after_the_first_iterations(results: list[dict]) -> None:
    """Compiles after step 0 (training) and step 1 (its eval forward, a graph of its own):
    none after."""
    for res in results:
        for name, r in res.items():
            c = r["compiles"]
            assert c[2:] == [c[2]] * (len(c) - 2), (name, c)


@pytest.mark.slow
def test_a_schedule_s_cut_pieces_merge_the_others(results: list[dict]) -> None:
    """cut_pieces (2,) of the plan's 5 pieces: the plan's pieces 0-1 and 2-4 merged, the graph
    cut only where the merged groups change in forward order (fewer pieces than uncut, the
    gradients in as many groups), training equal (above)."""
    for res in results:
        r = res["cut-pieces"]
        uncut = res["opt-overlap"]
        assert r["blocks"] == 5 and r["pieces"] == r["expected_pieces"] < uncut["pieces"], (r, uncut)
        assert r["clock_groups"] == r["pieces"], r
        assert r["gated"] >= 1 and not r["foreign"], r


@pytest.mark.slow
def test_graph_break_tied_lm_and_cut_tensors_still_split(results: list[dict]) -> None:
    r = results[0]["graph-break"]
    assert r["gated"] >= 2 and r["pieces"] >= 3, r      # both graphs, each split
    # Eager code between the graphs could read a parameter before a later graph's gate: the
    # updates run before the forward (the backward still hands each piece's gradients on).
    assert r["multi"] and results[0]["eager-read"]["multi"]
    assert not any(v.get("multi") for k, v in results[0].items()
                   if k not in ("graph-break", "eager-read")), results[0]
    lm = results[0]["tied-lm"]     # attention's (output, weights) tuples, a tied embedding
    assert lm["gated"] >= 1 and not lm["foreign"] and lm["pieces"] >= 3, lm
    cut = results[0]["cut-tensors"]
    # Every tensor's first part in ready order, then the rests in forward order: a tensor
    # belongs to its first block's piece, so the pieces follow the layers (8 Linear, the
    # norm's tensors with one of them); training is still equal (above).
    assert cut["pieces"] >= 8 and cut["gated"] >= 1, cut


def case_bad_cut(rank: int, ws: int) -> str:
    from usbyte_opt.runtime import DistributedOptimizer

    model = Deep()
    sched = dataclasses.replace(grouped(model, ws, 4), cut_pieces=(2, 99))
    try:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=sched,
                             verify=False)
    except Exception as e:   # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "accepted"


def test_a_cut_piece_the_plan_does_not_have_is_refused_on_every_rank() -> None:
    """cut_pieces naming a piece past the plan's (5 blocks of whole tensors: 5 pieces): one
    line naming the field, on both ranks, before anything trains (eager: no compile)."""
    res = run_local(case_bad_cut, 2, timeout_s=120, pg_timeout_s=60)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value.startswith("FormatError") and "cut_pieces[1]" in r.value, r.value
        assert "below 5" in r.value, r.value


def case_compiled_inside(rank: int, ws: int) -> dict:
    """A submodule compiled on its own inside an eager model (``net.a = torch.compile(net.a)``),
    AdamW, overlap mode: bitwise DDP over the same model (the updates of a training forward
    all run before it; left to the eager gates inside that graph, AdamW trained apart from
    DDP by about 1e-6 within 5 steps)."""
    import copy

    import usbyte_opt
    from usbyte_opt.runtime.default_plan import split_blocks

    torch.manual_seed(0)
    base = Deep(d=32)
    ref, mod = copy.deepcopy(base), copy.deepcopy(base)
    for m in (ref, mod):
        m.a = torch.compile(m.a, backend="eager")
    pb = problem_of(mod, ws)
    lay = pb.layout()
    sched = dataclasses.replace(pb.schedule("t", lay, split_blocks(pb, lay, 2)), mode=Mode.OVERLAP)
    ddp = DDP(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_mod = torch.optim.AdamW(mod.parameters(), lr=1e-2)
    net = usbyte_opt.DistributedDataParallel(mod, schedule=sched, optimizer=o_mod, verify=False)
    for step in range(STEPS):
        x, y = _batch(base, rank, step)
        for model, opt in ((ddp, o_ref), (net, o_mod)):
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    net.optimizer.synchronize()
    return {"diff": max_diff(ref, mod), "runtime": net.optimizer is not None}


def test_a_submodule_compiled_on_its_own_trains_as_ddp_with_adamw() -> None:
    res = run_local(case_compiled_inside, 2, timeout_s=300, pg_timeout_s=120)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value == {"diff": 0.0, "runtime": True}, r.value


def case_auto(rank: int, ws: int) -> dict:
    import usbyte_opt

    torch.manual_seed(0)
    mod = Deep()
    net = usbyte_opt.DistributedDataParallel(torch.compile(mod, backend="aot_eager"),
                                             schedule="auto")
    opt = torch.optim.SGD(mod.parameters(), lr=0.01)
    for step in range(14):
        x, y = _batch(mod, rank, step)
        (net(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    from usbyte_opt.runtime.compiled import _COMPILED_BY_DDP, _STATES

    st = _STATES[mod]
    return {**net.report(), "key": st.key, "resplits": st.resplits, "on_ddp": net._opt.on_ddp,
            "ddp_compiled": mod in _COMPILED_BY_DDP}


@pytest.mark.slow
def test_auto_says_a_compiled_model_is_planned_from_a_compiled_profile() -> None:
    """``schedule="auto"`` cannot time a compiled graph's parts from inside the run: every rank
    goes on with torch DDP and says how to plan it instead; the runtime's split is dropped,
    and torch's DDP compiles its own again (as without a plan)."""
    res = run_local(case_auto, 2, timeout_s=300, pg_timeout_s=120)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        assert r.value["chosen"] == "fallback", r.value
        assert "--compile BACKEND" in r.value["auto_error"], r.value
        # Dropped at the takeover (torch DDP's first iteration) and at the hand-back.
        seen = {k: r.value[k] for k in ("resplits", "key", "on_ddp", "ddp_compiled")}
        assert r.value["resplits"] == 2 and r.value["ddp_compiled"], seen
        assert r.value["key"] is None, r.value


def case_verify(rank: int, ws: int) -> dict:
    from torch._dynamo.utils import counters

    from usbyte_opt.runtime import DistributedOptimizer
    from usbyte_opt.runtime.compiled import _STATES

    torch._dynamo.reset()
    torch.manual_seed(0)
    mod = Deep()
    net = torch.compile(mod, backend="aot_eager")
    opt = DistributedOptimizer(torch.optim.SGD(mod.parameters(), lr=0.01), net,
                               schedule=grouped(mod, ws, 4), verify=True)
    compiles = []
    for step in range(90):
        x, y = _batch(mod, rank, step)
        (net(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        compiles.append(int(counters["stats"]["unique_graphs"]))
    st = _STATES[mod]
    rep = opt.report()
    return {"compiles": compiles, "resplits": st.resplits, "chosen": rep["chosen"],
            "settled_at": rep.get("settled_at_step"),
            "split_for_settled": st.key == opt._state.gates.split.key}


@pytest.mark.slow
def test_verification_keeps_one_split_and_the_settled_schedule_gets_its_own() -> None:
    """``verify=True`` on a compiled model: the plan's and DDP's buckets' turns share the
    split compiled first (no compile per turn); the schedule verification settles on runs
    split at its own pieces (one compile more where that is DDP's buckets)."""
    res = run_local(case_verify, 2, timeout_s=300, pg_timeout_s=120)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        v = r.value
        assert v["settled_at"] is not None and v["settled_at"] < 89, v
        before = v["compiles"][v["settled_at"] - 1]
        assert before == 1, v                                 # one split for every turn
        assert v["resplits"] == (1 if v["chosen"] == "fallback" else 0), v
        assert v["compiles"][-1] == before + v["resplits"], v
        assert v["split_for_settled"], v


def fusing(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """A backend that is not one of the bitwise ones by name (as inductor), computing as
    aot_eager does: the runtime treats it as one that may round the plan's pieces apart."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("aot_eager")(gm, example_inputs)


def _said() -> list[str]:
    from usbyte_opt.runtime.compiled import _SAID

    return sorted(_SAID)


def case_fusing(rank: int, ws: int, accept: bool) -> dict:
    """DDP's one line around a model compiled with :func:`fusing` (2 MB of weights: compiled
    DDP's pieces are its 1 MB first bucket and the rest), on a plan of 5 blocks."""
    v = _train(rank, ws, lambda: Deep(d=256), lambda m, w: grouped(m, w, 4),
               "late-wrap-compiled", backend=fusing, loop="clip",
               **({"accept_compiled_rounding": True} if accept else {}))
    return {**v, "said": _said()}


def test_a_backend_that_may_round_apart_compiles_at_ddp_s_buckets(default_cases) -> None:
    """Under a backend that may round the plan's pieces apart from compiled DDP's, the
    runtime keeps compiled torch DDP's own split (DDPOptimizer's, at DDP's buckets): training
    is bitwise with compiled DDP, gradients still come in DDP's pieces (blocks leave as each
    ends), no gate runs (updates before the forward), torch DDP's graphs of the first
    iteration serve on (no compile at the takeover), and every rank says so once."""
    for per_rank in default_cases:
        v = per_rank["fusing"]
        assert v["diff"] == 0.0, v
        assert v["at_ddp_buckets"] >= 1 and v["gated"] == 0 and v["foreign"], v
        assert v["pieces"] == 2 and v["clock_groups"] == 2 and v["blocks"] == 5, v
        assert v["resplits"] == 0, v
        c = v["compiles"]
        assert c[1] == c[0] and c[2:] == [c[2]] * (len(c) - 2), c   # (step 1's eval: one)
        line = [s for s in v["said"] if "compiled at DDP's buckets" in s]
        assert len(line) == 1 and "(fusing)" in line[0], v["said"]
        assert "accept_compiled_rounding=True" in line[0], line


@pytest.mark.slow
def test_accepting_the_rounding_compiles_the_plan_s_pieces() -> None:
    """``accept_compiled_rounding=True``: the same backend gets the plan's pieces (one
    compilation more at the takeover), gates and the one line that says so."""
    res = run_local(case_fusing, 2, args=(True,), timeout_s=300, pg_timeout_s=120)
    for r in res:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.trace}"
        v = r.value
        assert v["diff"] == 0.0, v    # (fusing computes as aot_eager)
        assert v["at_ddp_buckets"] == 0 and v["gated"] >= 1 and not v["foreign"], v
        assert v["pieces"] >= v["blocks"] - 1 and v["resplits"] == 1, v
        assert any("accept_compiled_rounding" in s and "(fusing)" in s for s in v["said"]), v


def test_backends_that_may_round_apart_are_named() -> None:
    """The one line said under a backend that fuses (inductor) names it; aot_eager's pieces
    compute what the whole graph computes, so nothing is said there."""
    from torch._dynamo.backends.registry import lookup_backend

    from usbyte_opt.runtime.compiled import BITWISE_BACKENDS, _backend_name

    assert _backend_name(lookup_backend("inductor")) == "inductor"
    assert _backend_name(lookup_backend("aot_eager")) in BITWISE_BACKENDS
