"""Real training side by side with DDP, measured against predicted (``usbyte-opt bench``).

:func:`run_bench` profiles a model on real ranks (or takes a profile), plans every strategy,
trains the same model with PyTorch DDP (and, when asked, PyTorch FSDP2: ``fsdp2``) and with
the runtime under each schedule — all-reduce schedules, and the sharded (ZeRO-1) ones of
:data:`SHARDED_STRATEGIES` — and returns the measured iteration times beside the simulator's
predictions, with every trainee's optimizer-state bytes per rank. It writes into
``out_dir``: ``result.json`` (the ``--json`` document), ``report.md``, ``plot.png`` (with
matplotlib), ``profile.json``, ``schedules/<strategy>.json``, ``traces/`` (measured, and
predicted beside measured) and ``logs/rank<r>.log``.

Where the ranks run:

* ``bandwidth`` given: in the lab (:mod:`usbyte_opt.bench.netlab`), one network namespace per
  rank, links shaped with tbf — root only; with ``nodes`` > 1 the two-level lab: one
  namespace per node, ``nproc`` ranks in each over its loopback, the nodes joined by the
  shaped links;
* otherwise on this machine's loopback (gloo, or NCCL with CUDA); with ``nodes`` > 1 the ranks
  are grouped into nodes there (torchrun's node variables, nothing shaped:
  :class:`~usbyte_opt.bench.netlab.LoopbackNodes`);
* under torchrun (``RANK`` set), on the ranks torchrun started: every rank calls
  :func:`run_bench`, rank 0 gets the result, the others ``None``.

The ranks are started by :func:`usbyte_opt.launcher.run_ranks`. Modules: :mod:`.job` (what
every rank is asked to do), :mod:`.worker` (what each rank runs), :mod:`.train` (timed
training loops), :mod:`.report` (statistics, Markdown, traces), :mod:`.plot` (the PNG),
:mod:`.lab` (the shaped network), :mod:`.models` (models sized for the lab), :mod:`.refine`
(the refined prediction).

Example::

    >>> cfg = BenchConfig(model="cnn", iterations=4, strategies=("ddp", "best"))
    >>> cfg.job(Path("out")).strategies
    ('ddp', 'best', 'no-comm')
    >>> result = run_bench(cfg)                         # doctest: +SKIP
    >>> [(r["strategy"], round(r["measured_ms"])) for r in result["runs"]]   # doctest: +SKIP
    [('ddp', 231), ('best', 187), ('no-comm', 160)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..env import TRACE_ENV
from ..errors import DistributedError, UsbyteError
from ..formats import Mode
from ..launcher import threads_per_rank
from ..planning.strategies import load_sharded
from ..profiler.options import ProfileOptions
from .job import Job
from .netlab import IFNAME
from .worker import REFERENCE, TORCH_DDP, TORCH_FSDP2

#: The planner's sharded strategies (schedules in ``Mode.SHARDED``, ZeRO-1 on the runtime)
#: that ``--strategies`` takes; planned by ``planning.planner.compare(..., shard=True)``
#: (:func:`plan_reports`).
SHARDED_STRATEGIES: tuple[str, ...] = tuple(load_sharded())
#: A sharded strategy's name with this suffix (``best-sharded-zero2``): its schedule trained
#: with ``zero_stage=2`` (ZeRO-2), beside the ZeRO-1 one when both are named.
ZERO2 = "-zero2"


def zero2_base(strategy: str) -> str | None:
    """The sharded strategy whose schedule ``strategy`` trains as ZeRO-2 (``None``: not such
    a name).

    Example::

        >>> zero2_base("best-sharded-zero2"), zero2_base("best-sharded"), zero2_base("best-zero2")
        ('best-sharded', None, None)
    """
    base = strategy[:-len(ZERO2)] if strategy.endswith(ZERO2) else None
    return base if base in SHARDED_STRATEGIES else None


def split_strategies(strategies: Sequence[str]) -> tuple[list[str], list[str]]:
    """``strategies`` split into those the all-reduce planner plans and the sharded ones
    (:data:`SHARDED_STRATEGIES`, and their ZeRO-2 names), each in the given order.

    Example::

        >>> split_strategies(["ddp", "fsdp-like", "best", "best-sharded-zero2"])
        (['ddp', 'best'], ['fsdp-like', 'best-sharded-zero2'])
    """
    sharded = [s for s in strategies if s in SHARDED_STRATEGIES or zero2_base(s)]
    return [s for s in strategies if s not in sharded], sharded


def running_world() -> int | None:
    """The world size of this process's initialised process group (the ranks the bench
    trains on), ``None`` without one; imports no torch that is not imported yet."""
    d = sys.modules.get("torch.distributed")
    if d is None or not d.is_available() or not d.is_initialized():
        return None
    return int(d.get_world_size())


#: The profile's ``meta`` key naming the emulated link (``8x1gbit@50us``) whose line replaced
#: the profile's communication (:func:`emulated_profile`).
EMULATED = "emulated_link"


def emulated_profile(profile: Any, spec: Any) -> Any:
    """``profile`` on the emulated link ``spec`` (a :class:`~usbyte_opt.collectives.emulate.LinkSpec`):
    its compute and host cost kept, its communication replaced by the link's lines
    (:func:`~usbyte_opt.collectives.emulate.comm_spec`: ``spec.ranks`` ranks, all-reduce
    ``alpha + 2(N-1)/N * b / rate``), and ``meta[EMULATED]`` naming the link, so that
    :func:`bench_profile` predicts with it on the one rank that trains.

    Example::

        >>> from usbyte_opt.collectives.emulate import parse_emulate
        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> p = emulated_profile(chain_profile([1000, 1000]), parse_emulate("8x1gbit"))
        >>> p.comm.world_size, p.meta[EMULATED], bench_profile(p, 1) is p
        (8, '8x1gbit@50us', True)
    """
    from ..collectives.emulate import comm_spec

    return dataclasses.replace(profile, comm=comm_spec(spec),
                               meta={**profile.meta, EMULATED: str(spec)})


def describe_link(spec: Any) -> str:
    """The emulated link ``spec`` in words, as the result and the report say it.

    Example::

        >>> from usbyte_opt.collectives.emulate import parse_emulate
        >>> describe_link(parse_emulate("8x1gbit"))  # doctest: +ELLIPSIS
        'emulated link: 8 ranks at 1 Gbit/s, alpha 50 µs: every collective occupies one ...'
    """
    from .netlab import format_rate

    return (f"emulated link: {spec.ranks} ranks at {format_rate(spec.bytes_per_s * 8)}, alpha "
            f"{spec.alpha_s * 1e6:g} µs: every collective occupies one serial channel for "
            "alpha + its ring bytes over the rate")


def check_emulate(emulate: str | None, nproc: int, nodes: int, bandwidth: str | None) -> Any:
    """The :class:`~usbyte_opt.collectives.emulate.LinkSpec` of ``--emulate`` (``None``
    without it), checked against the other options: it trains one rank, so ``--nproc-per-node
    1``, no ``--nodes``, no ``--bandwidth`` and no torchrun.

    Raises:
        UsageError: one line naming the value or the option that conflicts.
    """
    from ..collectives.emulate import parse_emulate
    from ..errors import UsageError

    if emulate is None:
        return None
    spec = parse_emulate(emulate)
    if nproc != 1:
        raise UsageError(f"--emulate trains one rank whose collectives occupy the emulated "
                         f"link: use --nproc-per-node 1, not {nproc}")
    if nodes != 1 or bandwidth:
        raise UsageError("--emulate is the link: leave out " + ("--bandwidth" if bandwidth else "--nodes"))
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise UsageError("--emulate trains one rank: run `usbyte-opt bench` without torchrun")
    return spec


def emulate_left_out(strategies: Sequence[str]) -> tuple[list[str], list[str]]:
    """``strategies`` without those ``--emulate`` cannot run, and a one-line note for each
    left out: the sharded ones (their reduce-scatters and all-gathers are not emulated, only
    plain all-reduce blocks), ``fsdp2`` (torch's own collectives) and ``auto`` (it plans in the
    run, from what one rank measures).

    Example::

        >>> kept, notes = emulate_left_out(["ddp", "best", "best-sharded", "no-comm"])
        >>> kept, len(notes)
        (['ddp', 'best', 'no-comm'], 1)
    """
    from ..env import AUTO

    _, sharded = split_strategies(strategies)
    out, notes = [], []
    for s in strategies:
        if s in sharded:
            notes.append(f"{s} left out under --emulate: only plain all-reduce blocks go through "
                         "the emulated link, not sharded mode's reduce-scatters and all-gathers")
        elif s == TORCH_FSDP2:
            notes.append(f"{s} left out under --emulate: FSDP2's own collectives do not go "
                         "through the emulated link")
        elif s == AUTO:
            notes.append(f"{s} left out under --emulate: it plans in the run from what one rank "
                         "measures, not from the emulated link")
        else:
            out.append(s)
    return out, notes


def bench_profile(profile: Any, world_size: int | None = None) -> Any:
    """The profile the bench predicts with on ``world_size`` ranks (default
    :func:`running_world`): on one rank, with nothing to communicate
    (:func:`usbyte_opt.planning.planner.single_rank`: compute plus host cost), whatever link
    the profile assumes (one rank's profile has an analytic 8-worker one), unless the link is
    an emulated one (:func:`emulated_profile`: kept); else ``profile``.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> p = chain_profile([1000, 1000])
        >>> bench_profile(p, 1).comm.alpha_ms, bench_profile(p, 2) is p
        (0.0, True)
    """
    from ..planning.planner import single_rank

    world = running_world() if world_size is None else world_size
    return single_rank(profile) if world == 1 and not profile.meta.get(EMULATED) else profile


def plan_reports(profile: Any, strategies: Sequence[str],
                 options: Mapping[str, Mapping[str, Any]] | None = None,
                 world_size: int | None = None) -> tuple[Any, Any]:
    """The planner's reports for ``strategies``: every registered all-reduce strategy
    (``compare(profile, names, options)``, so that ``best`` is seeded with all of them), and,
    only when ``strategies`` has sharded names, every one of :data:`SHARDED_STRATEGIES`
    (``compare(profile, names, shard=True)``; else ``None``). On one rank (``world_size``,
    default :func:`running_world`) nothing is communicated: the profile of
    :func:`bench_profile`.
    """
    from ..planning import planner
    from ..planning.strategies import load_builtin

    profile = bench_profile(profile, world_size)
    _, sharded = split_strategies(strategies)
    names = [n for n in load_builtin() if n not in SHARDED_STRATEGIES]
    report = planner.compare(profile, names, options=options)
    if not sharded:
        return report, None
    return report, planner.compare(profile, list(SHARDED_STRATEGIES), shard=True)


def flat_best() -> tuple[str, ...]:
    """``best-flat`` where the planner reports it (``best`` with every block flat, beside
    ``best`` on several nodes of several ranks), else nothing."""
    from ..planning import planner

    name = getattr(planner, "BEST_FLAT", None)
    return (name,) if isinstance(name, str) else ()


def default_strategies() -> tuple[str, ...]:
    """What ``--strategies`` defaults to: PyTorch DDP (``ddp``), then every registered
    strategy, in the registry's report order.

    Example::

        >>> s = default_strategies()
        >>> s[0], s[-1], "usbyte" in s
        ('ddp', 'best', True)
    """
    from ..planning.strategies import load_builtin

    return (TORCH_DDP, *(s for s in load_builtin() if s != TORCH_DDP))


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """Everything one benchmark run needs."""

    model: str
    """Built-in name, ``lab-cnn``/``lab-transformer`` or ``package.module:factory``."""
    nproc: int = 2
    """Ranks to start per node (on this machine)."""
    nodes: int = 1
    """Nodes to emulate on this machine, each of ``nproc`` ranks (torchrun's numbering: node
    k holds ranks k*nproc .. k*nproc+nproc-1); with ``bandwidth``, the two-level lab."""
    bandwidth: str | None = None
    """Link rate of the lab (``200mbit``); ``None``: the ordinary network."""
    iterations: int = 20
    """Timed steady-state iterations per strategy."""
    strategies: tuple[str, ...] = field(default_factory=default_strategies)
    """``ddp`` is PyTorch DDP itself, ``fsdp2`` PyTorch FSDP2; the others run on the runtime
    with their schedule (those of :data:`SHARDED_STRATEGIES` in sharded mode, as ZeRO-2 with
    the :data:`ZERO2` suffix)."""
    reference: bool = True
    """Also time training without communication (the compute the prediction assumes)."""
    profile: str | None = None
    """Use this profile instead of profiling."""
    batch_size: int | None = None
    out_dir: Path | None = None
    """Default ``bench-results/<name>-<network>``."""
    rounds: int = 4
    """Turns each strategy takes at least (interleaved, so noise hits all alike; each turn is
    a window of the comparison with DDP, :mod:`usbyte_opt.verdict`)."""
    max_rounds: int = 12
    """Turns to go up to while a strategy's time against DDP's is not distinguishable (the
    undecided strategies and DDP only); at most ``rounds``: exactly ``rounds``."""
    max_train_s: float = 600.0
    """No turn is added once the timed turns have taken this many seconds."""
    warmup: int = 2
    """Untimed iterations at the start of each turn."""
    device: str | None = None
    trace: bool = True
    """Record measured timelines of the runtime's strategies (each trainee's own trace file)."""
    plot: bool = True
    profiling: ProfileOptions = field(default_factory=lambda: ProfileOptions(comm_points=10))
    """How the model is profiled (ignored with ``profile``, but for its probe settings when
    that profile has no probe); its ``optimizer`` is the one trained with. The sweep's sizes
    default to ``comm_points`` from 4 KiB to the model's whole gradient."""
    time_budget_s: float = 0.6
    """Local-search seconds of ``best``."""
    verify: bool = False
    """Runtime strategies verify their plan against DDP's buckets (``--verify``)."""
    timeout_s: float = 1800.0
    """Hard limit of the ranks' run; past it they are killed."""
    threads: int | None = None
    """Torch threads per rank (default: cores / ranks)."""
    name: str | None = None
    first_warmup: int = 3
    """Untimed iterations of each strategy's first turn."""
    emulate: str | None = None
    """``NxRATE[@ALPHA]`` (:func:`~usbyte_opt.collectives.emulate.parse_emulate`): train one
    rank whose every collective occupies an emulated link of N ranks (``--emulate``), and
    predict with that link; ``None``: the real network."""

    def spec(self) -> tuple[str, int | None]:
        """The model spec the ranks build, and the default batch size of a lab model."""
        from ..models import LAB_MODELS

        if self.model in LAB_MODELS:
            return LAB_MODELS[self.model]
        return self.model, None

    def strategy_list(self) -> list[str]:
        """The strategies to train, each once, in order (``no-comm`` last with ``reference``).

        Raises:
            UsbyteError: an unknown name, or ``fsdp2`` on a torch without FSDP2 — before any
                rank starts.
        """
        from ..env import AUTO
        from ..planning.strategies import load_builtin
        from .train import fsdp2_missing

        registry = load_builtin()
        known = list(dict.fromkeys([*registry, AUTO, TORCH_FSDP2, *SHARDED_STRATEGIES,
                                    *(s + ZERO2 for s in SHARDED_STRATEGIES), *flat_best()]))
        out: list[str] = []
        for s in self.strategies:
            if s not in known:
                raise UsbyteError(f"--strategies: {s!r}: expected names among {', '.join(known)}")
            if s not in out:
                out.append(s)
        if TORCH_FSDP2 in out and (missing := fsdp2_missing()):
            raise UsbyteError(f"--strategies: {missing}")
        if not out:
            raise UsbyteError("--strategies: expected at least one strategy")
        if self.emulate is not None:
            out = emulate_left_out(out)[0]
            if not out:
                raise UsbyteError("--strategies: nothing left to train under --emulate "
                                  "(sharded strategies, fsdp2 and auto are left out)")
        if self.reference:
            out.append(REFERENCE)
        return out

    def job(self, out_dir: Path) -> Job:
        """The job every rank is given."""
        spec, lab_batch = self.spec()
        if self.iterations < 1:
            raise UsbyteError(f"--iterations: expected an integer >= 1, got {self.iterations}")
        job = Job(
            model=spec,
            name=self.name or _model_label(self.model),
            batch_size=self.batch_size if self.batch_size is not None else lab_batch,
            strategies=tuple(self.strategy_list()),
            iterations=self.iterations,
            rounds=self.rounds,
            warmup=self.warmup,
            profile=str(Path(self.profile).resolve()) if self.profile else None,
            out_dir=str(out_dir.resolve()),
            device=self.device,
            threads=self.threads or threads_per_rank(int(os.environ.get(
                "LOCAL_WORLD_SIZE", self.nproc * self.nodes))),   # every node on this machine
            profiling=self.profiling,
            verify=self.verify,
            time_budget_s=self.time_budget_s,
            trace=self.trace,
            pg_timeout_s=max(300.0, self.timeout_s),
            first_warmup=self.first_warmup,
            max_rounds=self.max_rounds,
            max_train_s=self.max_train_s,
            link=None if not self.bandwidth or "RANK" in os.environ else IFNAME,
            emulate=self.emulate,
        )
        return job


def _model_label(model: str) -> str:
    from ..models import model_name

    return model_name(model)


def network_info(lab: Any = None, emulate: Any = None) -> dict[str, Any]:
    """How the ranks were connected, for the report (``nodes`` and ``ranks_per_node``: the
    two-level lab's, or the nodes grouped on loopback; ``emulate``, a
    :class:`~usbyte_opt.collectives.emulate.LinkSpec`: the emulated link, in ``link``)."""
    if emulate is not None:
        return {"kind": "emulated", "short": f"emulated {emulate}",
                "description": describe_link(emulate),
                "link": {"spec": str(emulate), "ranks": emulate.ranks,
                         "rate_bps": emulate.bytes_per_s * 8, "alpha_us": emulate.alpha_s * 1e6}}
    if lab is not None and getattr(lab, "shaping", None) is not None:
        from .netlab import format_rate

        s = lab.shaping
        nodes = {"nodes": lab.nodes, "ranks_per_node": lab.ranks_per_node} \
            if lab.ranks_per_node > 1 else {}
        short = format_rate(s.rate_bps) + " lab" + (
            f", {lab.nodes} nodes x {lab.ranks_per_node}" if nodes else "")
        return {"kind": "lab", "rate_bps": s.rate_bps, "short": short, **nodes,
                "tbf": {"rate_bps": s.rate_bps, "burst_bytes": s.burst_bytes, "latency_ms": s.latency_ms},
                "description": f"lab at {format_rate(s.rate_bps)} ({lab.describe()})"}
    if lab is not None:   # nodes grouped on loopback
        return {"kind": "loopback", "short": f"loopback, {lab.nodes} nodes x {lab.ranks_per_node}",
                "nodes": lab.nodes, "ranks_per_node": lab.ranks_per_node,
                "description": lab.describe()}
    if "RANK" in os.environ:
        return {"kind": "torchrun", "short": "torchrun", "description": "the ranks torchrun started"}
    return {"kind": "loopback", "short": "loopback", "description": "this machine's loopback"}


def default_out_dir(cfg: BenchConfig) -> Path:
    tag = (cfg.bandwidth.replace("/", "") if cfg.bandwidth else
           "emulated-" + cfg.emulate.replace("@", "-") if cfg.emulate else "loopback")
    if cfg.nodes > 1:
        tag += f"-{cfg.nodes}x{cfg.nproc}"
    return Path("bench-results") / f"{cfg.name or _model_label(cfg.model)}-{tag}"


def _comm_sizes(job: Job) -> tuple[int, ...]:
    """Sweep sizes from 4 KiB to the model's whole gradient (at least 1 MiB): a slow link
    makes 64 MiB samples cost seconds each, and no block is ever larger than all gradients."""
    from ..collectives.sweep import default_sizes
    from ..models import build, parameter_count

    model, _, _ = build(job.model, job.batch_size, "cpu")
    total = 4 * parameter_count(model)
    del model
    return tuple(default_sizes(4 << 10, max(1 << 20, total), job.profiling.comm_points))


def _run_workers(job_path: Path, nproc: int, logs: Path, lab: Any, timeout_s: float,
                 progress: Callable[[str], None] | None) -> None:
    """Run ``nproc`` worker ranks on the job file (every rank's stderr in
    ``logs/rank<r>.log``, rank 0's progress lines to ``progress``) and wait for all of them.

    Raises:
        UsbyteError: a rank failed (its one-line error, naming the rank and its log).
        DistributedError: the ranks were still running after ``timeout_s`` (stopped).
    """
    from ..launcher import run_ranks

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(TRACE_ENV, None)  # the worker passes each trainee its own trace file
    res = run_ranks([sys.executable, "-m", "usbyte_opt.bench.worker", str(job_path)], nproc,
                    logs=logs, lab=lab, env=env, timeout_s=timeout_s, progress=progress,
                    poll_s=0.1)
    if res.timed_out:
        raise DistributedError(f"bench: ranks still running after {timeout_s:g} s; killed "
                               f"(logs in {logs})")
    if res.failed:
        r = res.failed[0]
        error = res.errors.get(r)
        msg = error.message if error is not None else f"exited with code {res.codes[r]}"
        raise UsbyteError(f"bench: rank {r}: {msg} (log: {logs / f'rank{r}.log'})")


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Run the benchmark of ``cfg``; return the result document (``None`` on ranks > 0 under
    torchrun). Writes the files listed in the module docstring; raises
    :class:`~usbyte_opt.errors.UsbyteError` (one line) on any failure."""
    from ..formats import write_json
    from ..models import resolve
    from . import report
    from .netlab import LoopbackNodes, check_nodes
    from .worker import run_rank

    t0 = time.perf_counter()
    out = cfg.out_dir or default_out_dir(cfg)
    check_nodes(cfg.nodes, cfg.nproc)
    emulate = check_emulate(cfg.emulate, cfg.nproc, cfg.nodes, cfg.bandwidth)
    world = cfg.nproc * cfg.nodes
    if emulate is not None and progress is not None:
        progress(describe_link(emulate) + "; training one rank")
    elif world < 2 and "RANK" not in os.environ and progress is not None:
        progress("one rank: no all-reduce to schedule; this measures the runtime's own cost "
                 "against DDP and checks the flow")
    job = cfg.job(out)
    resolve(job.model)  # a bad spec fails here, once, before any rank starts
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if cfg.bandwidth and torchrun:
        raise UsbyteError("--bandwidth starts its own ranks in the lab: run `usbyte-opt bench` "
                          "without torchrun")
    if cfg.nodes > 1 and torchrun:
        raise UsbyteError(f"--nodes {cfg.nodes}: under torchrun the nodes are torchrun's own "
                          "(--nnodes); leave --nodes out")
    for sub in ("traces", "schedules", "logs"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    if job.profile is None and not job.profiling.comm_sizes:
        job = dataclasses.replace(job, profiling=dataclasses.replace(job.profiling,
                                                                     comm_sizes=_comm_sizes(job)))
    job_path = write_json(out / "job.json", job.to_dict())
    lab = None
    if torchrun:
        raw = run_rank(job)
        if raw is None:
            return None
    else:
        from .netlab import Lab

        ctx: Any = contextlib.nullcontext()
        if cfg.bandwidth:
            ctx = Lab(world, cfg.bandwidth, ranks_per_node=cfg.nproc if cfg.nodes > 1 else 1)
        elif cfg.nodes > 1:
            ctx = LoopbackNodes(world, cfg.nproc)
        with ctx as lab:
            if lab is not None and progress:
                progress(("lab: " if cfg.bandwidth else "no --bandwidth: ") + lab.describe())
            _run_workers(job_path, world, out / "logs", lab, cfg.timeout_s, progress)
        raw = report.load_json(out / "raw.json")
    network = network_info(lab, emulate)
    result = report.summarize(raw, network, out)
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    notes = emulate_left_out(cfg.strategies)[1] if emulate is not None else []
    # Side-by-side traces: the prediction beside what every rank recorded.
    compare_docs = _compare_traces(raw, result, out)
    result["traces"] = {s: str(p) for s, (p, _) in compare_docs.items()}
    scale = result.get("compute_scale") or 1.0
    if abs(scale - 1.0) > 0.15:
        notes.append(f"Warning: training without communication ran at x{scale:.2f} of the profiled "
                     "compute: the machine's speed changed between profiling and training (a busy "
                     "or throttled spell), so every schedule was planned for a different balance of "
                     "compute and communication than the one it ran in. Run again, or pass "
                     "--profile with a profile taken on a quiet machine.")
    png = None
    if cfg.plot:
        from .plot import plot

        runtime = [r for r in result["runs"] if r.get("trace") and r["strategy"] in compare_docs]
        pick = min(runtime, key=lambda r: r["measured_ms"])["strategy"] if runtime else None
        png = plot(result, out / "plot.png", compare_docs[pick][1] if pick else None, pick or "")
        if png is None:
            notes.append("No plot: matplotlib is not installed (`pip install 'usbyte-opt[plot]'`).")
    result["plot"] = str(png) if png else None
    result["report"] = str(out / "report.md")
    result["notes"] = notes
    md = report.markdown(result, notes)
    tmp = out / "report.md.tmp"
    tmp.write_text(md)
    tmp.replace(out / "report.md")
    write_json(out / "result.json", result)
    return result


def _compare_traces(raw: dict[str, Any], result: dict[str, Any], out: Path) -> dict[str, tuple[Path, Any]]:
    from ..formats import load_profile, load_schedule, write_json
    from ..planning.simulate import MODES, chrome_trace, simulate
    from .report import compare_trace, load_json

    docs: dict[str, tuple[Path, Any]] = {}
    medians = {r["strategy"]: r["measured_ms"] for r in result["runs"]}
    prof = None
    for s, path in raw["schedules"].items():
        try:
            prof = prof or bench_profile(load_profile(raw["profile"]), raw["world_size"])
            sched = load_schedule(path)
            mode = (Mode.FENCE if s == TORCH_DDP else
                    Mode.SHARDED if sched.mode == Mode.SHARDED else Mode.OVERLAP)
            if mode not in MODES:
                continue
            predicted = chrome_trace(simulate(prof, sched, mode=mode), f"{s} (predicted)")
            measured = []
            mpath = raw["traces"].get(s)
            if mpath:
                from ..runtime.trace import path_for_rank

                for r in range(raw["world_size"]):
                    p = Path(path_for_rank(mpath, r))
                    if p.exists():
                        measured.append(load_json(p))
            doc = compare_trace(predicted, measured, medians.get(s, 0.0))
            docs[s] = (write_json(out / "traces" / f"{s}.compare.json", doc), doc)
        except (OSError, ValueError, KeyError, UsbyteError):
            continue  # a missing trace costs the picture, not the result
    return docs


__all__ = ["EMULATED", "SHARDED_STRATEGIES", "ZERO2", "zero2_base", "BenchConfig", "Job",
           "ProfileOptions", "bench_profile", "check_emulate", "default_strategies",
           "describe_link", "emulate_left_out", "emulated_profile", "flat_best", "network_info",
           "plan_reports", "run_bench", "running_world", "split_strategies"]
