"""Planning and verifying inside the user's own run: ``schedule="auto"`` and ``verify=True``.

**Auto** (``schedule="auto"``, ``USBYTE_SCHEDULE=auto``, ``usbyte-opt launch --schedule
auto``). The run starts on DDP's buckets (the fallback plan, in fence mode: it trains exactly
as DDP). Then, inside the user's loop:

1. :data:`WARMUP` iterations as they are;
2. :data:`CLEAN` iterations measured with communication held back until backward ends, so
   that compute is timed alone: the start and end of forward and backward, the first use of
   each tensor in forward (its module's pre-hook), when each gradient is final (its
   post-accumulate-grad hook), the optimizer step (CUDA events on a GPU, ``perf_counter`` on
   a CPU);
3. :data:`OVERLAP` iterations with communication as usual, for what it costs backward (the
   compute-cost option of the profile, on CPUs);
4. at the next step boundary, every rank: the measurements, maximum over ranks (the control
   group); a short all-reduce sweep on the runtime's own channel for ``alpha`` and the
   bandwidth; rank 0 builds the profile, plans it exactly as ``usbyte-opt optimize`` does
   (:func:`usbyte_opt.planning.planner.compare`, its ``best``) and broadcasts the schedule; every rank
   switches to it at the same iteration. The profile and the schedule are written to
   ``auto_dir`` (or ``$USBYTE_AUTO_DIR``) for ``optimize``, ``simulate`` and ``bench``.

**Verify** (``verify=True``, the default, for a plan given or planned). The plan and DDP's
buckets run in interleaved windows of :data:`WINDOW` iterations, a round being one window of
each, the order alternating; an iteration's time is the interval between two ``step()``
calls, the first interval of a window (the switch) dropped, and a window's time is its median.
After every round, the round's two window medians are summed over the ranks (the control
group), so every rank holds the same figures whatever its own timings, and every rank applies
the same rule to them (:mod:`usbyte_opt.verdict`): the plan's time over DDP's buckets' time
from the paired windows, with its 95% interval; rounds are added (at least
:data:`MIN_ROUNDS`, at most :data:`MAX_ROUNDS`, none once :data:`VERIFY_S` seconds have gone)
until the interval excludes 1. The plan is kept only when its interval lies below 1 (measurably
faster); slower, or not distinguishable on this machine, the run goes on with DDP's buckets.
A round is :data:`WINDOW` iterations of each side, so the first verdict can come after
``MIN_ROUNDS * 2 * WINDOW`` iterations (:meth:`Tuner.needed`). The run's summary
(:mod:`usbyte_opt.voice`, printed once when the run ends) is :meth:`Tuner.summary`: what runs, its
speed against DDP's buckets' (>1 is faster) with the interval, and the prediction, how many
iterations ran on each side, or how far verification got when the run ended before a
verdict; :meth:`Tuner.report` holds the figures. Afterwards,
every ``check_every`` iterations the measured median is compared with the prediction; more than
:data:`DRIFT` apart, rank 0 warns once, and ``replan()`` (or ``replan_on_drift``) plans again.
The check costs no host wait: on CUDA it reads only the step events that have completed
(the rest wait for the next check), and the ranks' median goes out on the control group at
one check and is read at the next, one window later, when it has long arrived. With
``check_every=0`` nothing is recorded once settled.

None of this changes the training's arithmetic: every plan sums the same gradients (with two
ranks, bitwise; with more, as exactly as any change of DDP's buckets), holding communication
back only delays it, and the switches happen between steps, after every update.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..env import AUTO_DIR_ENV
from ..errors import UsbyteError, plural
from ..formats import CommSpec, HostCost, Profile, Schedule, TensorSpec, dump_schedule, parse_schedule
from ..verdict import Budget, Ratio

#: Iterations before measuring (the first one learns the hooks' order).
WARMUP = 2
#: Iterations measured with communication held back until backward ends.
CLEAN = 5
#: Iterations measured with communication as usual.
OVERLAP = 4
#: Iterations per verification window (the first interval of each dropped: the switch).
WINDOW = 3
#: Rounds of (plan, DDP's buckets) windows: at least, at most, and no round started after
#: this many seconds of verification (:class:`usbyte_opt.verdict.Budget`).
MIN_ROUNDS = 4
MAX_ROUNDS = 12
VERIFY_S = 120.0
#: What the plan is verified against, in what users read.
DDP_BUCKETS = "DDP's buckets"
#: Measured and predicted this far apart (relative) give a warning.
DRIFT = 0.15
#: Default interval (iterations) of the drift check.
CHECK_EVERY = 200


class _Clock:
    """Stamps: ``perf_counter`` seconds on CPU, CUDA events on the gradients' device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def ms(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return (b - a) * 1e3
        return a.elapsed_time(b)

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


class IterationStamps:
    """One measured iteration's stamps (called from the runtime's hooks)."""

    def __init__(self, n: int, clock: _Clock):
        self.clock = clock
        self.n = n
        self.f0: Any = None
        self.f1: Any = None
        self.b1: Any = None
        self.u0: Any = None
        self.u1: Any = None
        self.need_at: list[Any] = [None] * n
        self.ready_at: list[Any] = [None] * n
        self.issued_in_backward = 0

    def forward_begin(self) -> None:
        if self.f0 is None:
            self.f0 = self.clock.now()

    def need(self, ts: Sequence[int]) -> None:
        if self.f0 is None or self.f1 is not None:
            return
        at = None
        for t in ts:
            if self.need_at[t] is None:
                if at is None:
                    at = self.clock.now()
                self.need_at[t] = at

    def forward_end(self) -> None:
        if self.f0 is not None and self.f1 is None:
            self.f1 = self.clock.now()

    def ready(self, t: int) -> None:
        self.ready_at[t] = self.clock.now()

    def backward_end(self, issued: int) -> None:
        self.b1 = self.clock.now()
        self.issued_in_backward = issued

    def update_begin(self) -> None:
        self.u0 = self.clock.now()

    def update_end(self) -> None:
        self.u1 = self.clock.now()

    def result(self) -> dict[str, Any] | None:
        """Milliseconds (call after the clock settled); None if the iteration was incomplete."""
        c = self.clock
        if self.f0 is None or self.f1 is None or self.b1 is None:
            return None
        return {
            "F": c.ms(self.f0, self.f1), "B": c.ms(self.f1, self.b1),
            "step": c.ms(self.u0, self.u1) if self.u0 is not None and self.u1 is not None else 0.0,
            "need": [c.ms(self.f0, x) if x is not None else math.nan for x in self.need_at],
            "ready": [c.ms(self.f1, x) if x is not None else math.nan for x in self.ready_at],
            "issued": self.issued_in_backward,
        }


class StepTimer:
    """Iteration times: the intervals between consecutive ``step()`` calls."""

    def __init__(self, clock: _Clock):
        self.clock = clock
        self.stamps: list[Any] = []

    def mark(self) -> None:
        self.stamps.append(self.clock.now())

    def take(self, drop_first: int = 1) -> list[float]:
        """The intervals marked so far (after the first ``drop_first``), and start afresh."""
        self.clock.settle()
        st, self.stamps = self.stamps, self.stamps[-1:]
        out = [self.clock.ms(a, b) for a, b in zip(st, st[1:])]
        return out[drop_first:]

    def take_ready(self) -> list[float]:
        """The intervals between stamps that have completed, without waiting for the device;
        the stamps not completed yet (and the last completed one) stay for the next call."""
        st = self.stamps
        done = len(st)
        if self.clock.cuda:
            done = 0
            while done < len(st) and st[done].query():   # recorded in order on one stream
                done += 1
        if done < 2:
            return []
        out = [self.clock.ms(a, b) for a, b in zip(st[:done], st[1:done])]
        self.stamps = st[done - 1:]
        return out


def _median(xs: Sequence[float]) -> float:
    ys = sorted(x for x in xs if not math.isnan(x))
    if not ys:
        return math.nan
    k = len(ys) // 2
    return ys[k] if len(ys) % 2 else 0.5 * (ys[k - 1] + ys[k])


class Tunable(Protocol):
    """What the tuner needs of the optimizer it tunes (the
    :class:`~usbyte_opt.runtime.DistributedOptimizer` hands it an adapter that provides it).

    Every collective here goes through the optimizer's own channel (its control group for
    host tensors), in the same order on every rank.
    """

    #: This rank, and the ranks of the data-parallel group.
    rank: int
    world_size: int
    #: The gradients' device; the data-parallel process group (``None``: the default group).
    device: torch.device
    group: dist.ProcessGroup | None

    @property
    def schedule(self) -> Schedule:
        """The schedule running now."""

    @property
    def schedule_source(self) -> str:
        """Where it came from."""

    @property
    def tensor_count(self) -> int:
        """Trainable tensors (the indices the probe's hooks report)."""

    @property
    def grad_itemsize(self) -> int:
        """Bytes per element of the first flat gradient buffer."""

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The trainable tensors, name and parameter, by runtime index."""

    @property
    def compiled(self) -> bool:
        """Whether the model's forward runs as split compiled graphs (``torch.compile``)."""

    def settled(self) -> None:
        """The tuner settled: what runs now runs for good (torch's DDP gets back what it
        would have had without a plan, :meth:`usbyte_opt.runtime.compiled.PlanSplit.settle`)."""

    def set_probe(self, probe: IterationStamps | None) -> None:
        """Have the hooks stamp into ``probe`` from now on (``None``: stop)."""

    def hold_communication(self, hold: bool) -> None:
        """Issue no block before the end of backward (compute timed alone), or stop holding."""

    def control_all_reduce(self, t: torch.Tensor,
                           op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work | None:
        """Reduce a host tensor over the ranks on the control group (``None`` on one rank)."""

    def control_broadcast(self, t: torch.Tensor) -> dist.Work | None:
        """Rank 0's host tensor to every rank on the control group (``None`` on one rank)."""

    def wait_host(self, work: dist.Work, what: str) -> None:
        """Wait on the host for a control message (``what`` names it in errors)."""

    def all_reduce(self, t: torch.Tensor) -> dist.Work:
        """Sum ``t`` over the ranks as a gradient block is (the sweep's collective)."""

    def synchronize(self) -> None:
        """Finish all communication and updates (the optimizer's ``synchronize()``)."""

    def switch(self, schedule: Schedule, source: str, measure: bool = False) -> None:
        """Run ``schedule`` from the next iteration on (every rank at the same step)."""


class Tuner:
    """The state machine of auto planning and verification of one optimizer (see module).

    Args:
        opt: the optimizer tuned (:class:`Tunable`).
        fallback: DDP's buckets (the DDP-like fallback plan), the very object the optimizer
            runs when it runs them (schedules are compared by identity).
        auto: plan inside the run first.
        verify: verify the plan against DDP's buckets.
        auto_dir: where an auto run writes its profile and schedule.
        check_every: iterations between drift checks (0: none).
        replan_on_drift: plan again (auto) when the drift check fails.
    """

    def __init__(self, opt: Tunable, fallback: Schedule, auto: bool, verify: bool,
                 auto_dir: str | os.PathLike | None, check_every: int = CHECK_EVERY,
                 replan_on_drift: bool = False):
        self.opt = opt
        self.rank = opt.rank
        self.ws = opt.world_size
        self.clock = _Clock(opt.device)
        self.timer = StepTimer(self.clock)
        self.fallback = fallback
        self.auto = auto
        self.verify = verify
        self.auto_dir: str | os.PathLike | None = (
            auto_dir if auto_dir is not None else os.environ.get(AUTO_DIR_ENV) or None)
        self.check_every = check_every
        self.replan_on_drift = replan_on_drift
        self.plan: tuple[Schedule, str] = (opt.schedule, opt.schedule_source)
        #: What the plan is timed against, in words: DDP's buckets run by the runtime, or
        #: torch DDP itself (:meth:`~usbyte_opt.runtime.DistributedOptimizer.use_ddp_fallback`).
        self.against = DDP_BUCKETS
        self.steps = 0
        #: Iterations run on each side so far (the whole run: the summary says them), and the
        #: side running now.
        self.ran = {"plan": 0, "fallback": 0}
        self.on = "plan"
        self.phase = "idle"
        self.phase_step = 0
        self.probes: list[IterationStamps] = []
        self.measured: dict[str, list[dict[str, Any]]] = {"clean": [], "overlap": []}
        self.windows: list[tuple[str, list[float]]] = []
        #: Each round's (plan, DDP's buckets) window medians, mean over the ranks.
        self.rounds: list[tuple[float, float]] = []
        self.budget = Budget(MIN_ROUNDS, MAX_ROUNDS, VERIFY_S)
        self.verify_t0 = 0.0
        self.ratio: Ratio | None = None
        self.recent: list[float] = []
        self.warned = False
        self.replan_asked = False
        #: Why the run settled on DDP's buckets without a verdict (a planning failure), if so.
        self.note = ""
        #: The drift check's all-reduce in flight (sent at one check, read at the next).
        self.drift_work: tuple[Any, torch.Tensor] | None = None
        self.info: dict[str, Any] = {"auto": auto, "verify": verify, "chosen": None,
                                     "measured_ms": {}, "predicted_ms": None}
        #: The running schedule was installed to be measured (``auto``: DDP's buckets on the
        #: runtime); settling on the fallback then switches to the fallback proper (torch's
        #: DDP where it is the fallback).
        self._measuring = auto
        if self.ws < 2:
            self.info["note"] = "world size 1: nothing to plan or verify"
            self.phase = "settled"
        elif auto:
            self._begin("warmup")
        elif verify:
            self._begin_verify()
        else:
            self.phase = "settled"
        if auto:
            self.on = "fallback"

    # -- the state machine -----------------------------------------------------------------

    def _begin(self, phase: str) -> None:
        self.phase = phase
        self.phase_step = 0
        self.opt.hold_communication(phase == "clean")
        if phase in ("clean", "overlap"):
            self._arm()
        else:
            self.opt.set_probe(None)

    def _arm(self) -> None:
        p = IterationStamps(self.opt.tensor_count, self.clock)
        self.probes.append(p)
        self.opt.set_probe(p)

    def _collect(self, kind: str) -> None:
        self.clock.settle()
        for p in self.probes:
            r = p.result()
            if r is not None:
                self.measured[kind].append(r)
        self.probes = []

    def after_step(self) -> None:
        """Called at the end of every ``step()`` (same count on every rank)."""
        self.steps += 1
        self.ran[self.on] += 1
        self.phase_step += 1
        ph = self.phase
        if ph != "settled" or (self.check_every and not self.replan_asked):
            self.timer.mark()   # settled with check_every=0: nothing kept
        if ph == "warmup":
            if self.phase_step >= WARMUP:
                self._begin("clean")
        elif ph in ("clean", "overlap"):
            n = CLEAN if ph == "clean" else OVERLAP
            if self.phase_step >= n:
                self._collect(ph)
                if ph == "clean":
                    self._begin("overlap")
                else:
                    self.opt.set_probe(None)
                    self._plan_now()
            else:
                self._arm()
        elif ph == "verify":
            if self.phase_step >= WINDOW:
                self.windows.append((_side(len(self.windows)), self.timer.take()))
                if len(self.windows) % 2 == 0 and not self._round_done():
                    self._decide()
                else:
                    self._run(_side(len(self.windows)))
                    self.phase_step = 0
        elif ph == "settled":
            if self.replan_asked:
                self.replan_asked = False
                self._restart()
            elif self.check_every and self.steps % self.check_every == 0:
                self._check_drift()

    def _restart(self) -> None:
        self.measured = {"clean": [], "overlap": []}
        self.windows = []
        self.rounds = []
        self.ratio = None
        if self.drift_work is not None and self.drift_work[0] is not None:
            self.opt.wait_host(self.drift_work[0], "all-reduce of the drift check")
        self.drift_work = None
        self.timer.take()
        if self.auto:
            self._run("fallback", measure=True)   # planning measures the runtime itself
            self._begin("warmup")
        elif self.verify:
            self._begin_verify()

    def _run(self, which: str, measure: bool = False) -> None:
        sched, source = (self.fallback, "<DDP's buckets>") if which == "fallback" else self.plan
        self.on = which
        if self.opt.schedule is not sched or measure or self._measuring:
            self.opt.switch(sched, source, measure)
        self._measuring = measure

    # -- auto --------------------------------------------------------------------------------

    def _plan_now(self) -> None:
        t0 = time.perf_counter()
        opt = self.opt
        opt.synchronize()
        try:
            profile = self._profile()
        except UsbyteError as e:  # every rank fails alike: the measurements were agreed
            self.info["auto_error"] = str(e)
            self._settle_on("fallback", note=f"auto planning failed: {e}")
            return
        sched_json = None
        err = ""
        if self.rank == 0:
            try:
                from ..planning.planner import compare

                report = compare(profile)
                sched = report.schedule("best")
                sched_json = json.dumps(dump_schedule(sched))
            except Exception as e:  # noqa: BLE001 - shared with the other ranks below
                err = f"{type(e).__name__}: {e}"
        payload = self._broadcast(json.dumps({"schedule": sched_json, "error": err}))
        msg = json.loads(payload)
        if msg["error"]:
            self.info["auto_error"] = msg["error"]
            self._settle_on("fallback", note=f"auto planning failed: {msg['error']}")
            return
        sched = parse_schedule(json.loads(msg["schedule"]), "<auto schedule>")
        self.plan = (sched, "<auto schedule>")
        self.info["auto_plan_s"] = time.perf_counter() - t0
        self.info["auto_settled_at_step"] = self.steps
        self.info["predicted_ms"] = sched.predicted.get("iteration_ms")
        self.info["lower_bound_ms"] = sched.predicted.get("lower_bound_ms")
        self.info["plan"] = {"strategy": sched.strategy, "mode": sched.mode,
                             "blocks": len(sched.blocks)}
        if self.rank == 0 and self.auto_dir:
            self._write(profile, sched)
        self._run("plan")
        if self.verify:
            self._begin_verify()
        else:
            self._settle_on("plan")

    def _profile(self) -> Profile:
        opt = self.opt
        named = opt.tensors()
        n = len(named)
        clean, over = self.measured["clean"], self.measured["overlap"]
        if not clean:
            if opt.compiled:
                raise UsbyteError("the model runs compiled (torch.compile), and a compiled "
                                  "graph's parts cannot be timed from inside the run: plan it "
                                  "with `usbyte-opt profile MODEL --compile BACKEND` (under torchrun), "
                                  "`usbyte-opt optimize`, and pass the schedule")
            raise UsbyteError("no complete iteration was measured (a forward outside the "
                              "model's own forward)")
        F = _median([r["F"] for r in clean])
        B = _median([r["B"] for r in clean])
        step = _median([r["step"] for r in clean])
        B_over = _median([r["B"] for r in over]) if over else B
        ready = [_median([r["ready"][t] for r in clean]) for t in range(n)]
        need = [_median([r["need"][t] for r in clean]) for t in range(n)]
        issued = _median([float(r["issued"]) for r in over]) if over else 0.0
        # Maximum over ranks (the slowest rank gates every collective); -1 marks "none".
        vec = torch.tensor([F, B, step, B_over] + [x if not math.isnan(x) else -1.0 for x in ready]
                           + [x if not math.isnan(x) else -1.0 for x in need], dtype=torch.float64)
        work = opt.control_all_reduce(vec, dist.ReduceOp.MAX)
        if work is not None:
            opt.wait_host(work, "all-reduce of the tuner's measurements")
        vals = vec.tolist()
        F, B, step, B_over = (max(v, 1e-3) for v in vals[:4])
        ready = [min(v, B) if v >= 0 else B for v in vals[4:4 + n]]
        need = [min(v, F) if v >= 0 else F for v in vals[4 + n:]]
        numel = [int(p.numel()) for _, p in named]
        total = sum(numel) or 1
        tensors = []
        for t in range(n):
            name, p = named[t]
            tensors.append(TensorSpec(name, tuple(int(d) for d in p.shape),
                                      str(p.dtype).removeprefix("torch."), ready[t], need[t],
                                      step * numel[t] / total))
        swept = self._sweep(sum(p.numel() * p.element_size() for _, p in named))
        lost = B_over - B
        bytes_bw = 0
        if issued > 0:
            blocks = opt.schedule.blocks
            size = opt.grad_itemsize
            bytes_bw = sum((b.end - b.start) * size for b in blocks[:int(round(issued))])
        cpu_mb = 0.0
        if not self.clock.cuda and lost > 0.05 * B and bytes_bw > 0:
            cpu_mb = lost / (bytes_bw / 1e6)
        from ..formats.schema import MAX_ALGBW_GBS, MAX_MS

        comm = CommSpec(swept.backend, swept.world_size, min(swept.alpha_ms, MAX_MS),
                        min(swept.algbw_gbs, MAX_ALGBW_GBS), swept.samples, 0.0, cpu_mb)
        meta = {"source": "usbyte_opt.runtime auto (measured in the training run)",
                "iterations": {"clean": len(clean), "overlap": len(over)},
                "backward_with_comm_ms": B_over, "device": opt.device.type}
        # The host's cost per tensor and per block, as a profile file without a measured
        # ``host`` section is planned with (the planner charges it on the critical path).
        return Profile("auto", F, B, tuple(tensors), comm, meta,
                       HostCost.default(str(opt.device)))

    def _sweep(self, total_bytes: int) -> CommSpec:
        from ..collectives.issuers import backend_for
        from ..collectives.sweep import default_sizes, fit_comm, sweep_allreduce

        opt = self.opt
        # Up to the whole gradient, and at least 4 MiB: below that a link's bandwidth does not
        # show against its latency, and the fit could not tell it.
        hi = max(4 << 20, min(64 << 20, int(total_bytes)))
        sizes = default_sizes(4 << 10, hi, 6)

        def barrier() -> None:
            x = torch.zeros(1)
            w = opt.control_all_reduce(x)
            if w is not None:
                opt.wait_host(w, "tuner barrier")

        sweep = sweep_allreduce(sizes, repeats=3, warmup=1, device=opt.device, group=opt.group,
                                barrier=barrier, issue=opt.all_reduce)
        spec, _ = fit_comm(sweep, backend_for(opt.group, opt.device), self.ws)
        return spec

    def _broadcast(self, text: str) -> str:
        """Rank 0's ``text`` on every rank (the control group)."""
        opt = self.opt
        data = text.encode() if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        w = opt.control_broadcast(n)
        if w is not None:
            opt.wait_host(w, "broadcast of the planned schedule")
        buf = torch.zeros(int(n.item()), dtype=torch.uint8)
        if self.rank == 0:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        w = opt.control_broadcast(buf)
        if w is not None:
            opt.wait_host(w, "broadcast of the planned schedule")
        return bytes(buf.tolist()).decode()

    def _write(self, profile: Profile, sched: Schedule) -> None:
        from ..formats import save_profile, save_schedule

        where = self.auto_dir
        assert where is not None   # called only with a folder to write to
        try:
            os.makedirs(where, exist_ok=True)
            p = save_profile(profile, os.path.join(where, "profile.json"))
            s = save_schedule(sched, os.path.join(where, "schedule.json"))
            self.info["files"] = {"profile": str(p), "schedule": str(s)}
        except OSError as e:
            warnings.warn(f"{self.auto_dir}: cannot write the auto profile and schedule "
                          f"({e.strerror})", _warning_class(), stacklevel=2)

    # -- verify ------------------------------------------------------------------------------

    def _begin_verify(self) -> None:
        self.phase = "verify"
        self.phase_step = 0
        self.windows = []
        self.rounds = []
        self.ratio = None
        self.verify_t0 = time.perf_counter()
        self.timer.take()
        self._run(_side(0))

    def _round_done(self) -> bool:
        """A round of windows has ended: agree on its medians over the ranks, and say whether
        to take another (:meth:`usbyte_opt.verdict.Budget.more`, on figures every rank holds
        alike, so every rank goes on or stops at the same step)."""
        plan = [x for w, xs in self.windows[-2:] if w == "plan" for x in xs]
        fb = [x for w, xs in self.windows[-2:] if w == "fallback" for x in xs]
        vec = torch.tensor([_median(plan), _median(fb), time.perf_counter() - self.verify_t0],
                           dtype=torch.float64)
        work = self.opt.control_all_reduce(vec)
        if work is not None:
            self.opt.wait_host(work, "all-reduce of the verification medians")
        plan_ms, fb_ms, elapsed = (v / self.ws for v in vec.tolist())
        self.rounds.append((plan_ms, fb_ms))
        self.ratio = self.budget.compare([f for _, f in self.rounds], [p for p, _ in self.rounds])
        return self.budget.more(len(self.rounds), elapsed, self.ratio)

    def _decide(self) -> None:
        r = self.ratio
        assert r is not None   # set by the last round
        plan_ms = _median([p for p, _ in self.rounds])
        fb_ms = _median([f for _, f in self.rounds])
        self.info["measured_ms"] = {"plan": plan_ms, "fallback": fb_ms}
        self.info["vs_ddp_buckets"] = {**r.to_dict(), "verdict": r.verdict(self.against, "the plan")}
        self.info["rounds"] = len(self.rounds)
        if self.info["predicted_ms"] is None:
            self.info["predicted_ms"] = self.plan[0].predicted.get("iteration_ms")
        # Kept only when measurably faster: noise alone never keeps a slower plan.
        self._settle_on("plan" if r.hi < 1.0 else "fallback")

    def _settle_on(self, which: str, note: str = "") -> None:
        self._run(which)
        self.opt.settled()
        self.phase = "settled"
        self.opt.hold_communication(False)
        self.opt.set_probe(None)
        self.info["chosen"] = which
        self.info["settled_at_step"] = self.steps
        self.info["summary"] = self.summary(note)
        self.note = note
        self.timer.take()

    def _what(self) -> str:
        sched = self.plan[0]
        if str(getattr(sched, "runner", "runtime")) == "ddp":
            return f"{sched.strategy} (torch DDP, {plural(len(sched.blocks), 'planned bucket')})"
        return f"{sched.strategy} ({sched.mode}, {plural(len(sched.blocks), 'block')})"

    def _predicted_ratio(self) -> str:
        """The prediction beside the measurement: the plan's speedup over DDP as the planner
        predicted it (the schedule's ``baselines``), else the plan's predicted ms."""
        pred = self.info.get("predicted_ms") or self.plan[0].predicted.get("iteration_ms")
        ddp = (self.plan[0].predicted.get("baselines") or {}).get("ddp")
        if pred and ddp:
            return f"predicted {ddp / pred:.2f}x"
        return f"predicted {pred:.1f} ms per iteration" if pred else "no prediction"

    def _counts(self) -> str:
        """How many iterations ran on each side, so far."""
        return (f"{plural(self.ran['plan'], 'iteration')} on the plan, {self.ran['fallback']} "
                f"on {self.against}")

    def final_summary(self) -> str:
        """The summary when the run ends (:mod:`usbyte_opt.voice`): counts up to date, and how far the
        run got if it ended before a verdict."""
        return self.summary(self.note, ended=True)

    def needed(self) -> int:
        """Iterations verification takes at the least before a verdict."""
        return MIN_ROUNDS * 2 * WINDOW

    def summary(self, note: str = "", ended: bool = False) -> str:
        """One line: what runs and why, in speedups over DDP (>1 is faster) — the plan kept
        with its speed against DDP's buckets' (interval) and the prediction, or DDP's buckets
        and why (the plan slower, not measurably faster, planning failed), or, before that,
        how far the run got (``ended``: the run is over) — and how many iterations ran on
        each side."""
        i = self.info
        what = self._what()
        r = self.ratio
        m = i.get("measured_ms") or {}
        counts = self._counts()
        if self.phase != "settled":
            if self.phase == "verify":
                if ended:
                    head = (f"no verdict: the run ended after {plural(self.steps, 'iteration')}, "
                            f"while timing the plan {what} against {self.against} in turns "
                            f"({counts}); ")
                    if self.steps < self.needed() or r is None:
                        return head + (f"a verdict needs at least {self.needed()} (verify=False "
                                       "runs the plan without timing it)")
                    return head + (f"not distinguishable yet ({r.noise()} on this machine after "
                                   f"{plural(len(self.rounds), 'round')}); verification goes on "
                                   f"for up to {MAX_ROUNDS * 2 * WINDOW} iterations")
                return (f"verifying the plan {what} against {self.against} "
                        f"({plural(len(self.rounds), 'round')} of windows so far; {counts})")
            if ended:
                return (f"no plan yet: the run ended after {plural(self.steps, 'iteration')} on "
                        f"DDP's buckets, before the plan was made (planning in the run measures "
                        f"its first {WARMUP + CLEAN + OVERLAP} iterations)")
            return f"running {self.against} while measuring the run to plan it"
        if i.get("note") and self.ws < 2:
            return "one rank: nothing to plan or verify"
        if r is None and i["chosen"] != "fallback":
            how = "as planned in the run" if self.auto else "as given"
            return (f"ran the plan {what} {how} (verify=False: not timed against {self.against}; "
                    f"{counts})")
        if r is None:
            return (f"running {self.against}" + (f": {note}" if note else "") + self._fallback_cost()
                    + f" ({counts})")
        s = r.inverse()
        ms = (f"; {m['plan']:.1f} against {m['fallback']:.1f} ms per iteration over "
              f"{plural(r.pairs, 'round')}" if m else "")
        fig = (f"{s.ratio:.2f}x {_possessive(self.against)} speed "
               f"({round(100 * s.confidence)}% CI {s.interval()}{ms})")
        pred = self._predicted_ratio()
        if i["chosen"] == "plan":
            return f"kept the plan {what}: {fig}, {pred}; {counts}"
        if r.lo > 1.0:
            return (f"running {self.against}: the plan {what} was slower: {fig}, {pred}"
                    + self._fallback_cost() + f"; {counts}")
        return (f"running {self.against}: the plan {what} was not measurably faster "
                f"({r.noise()} on this machine): {fig}, {pred}" + self._fallback_cost()
                + f"; {counts}")

    def _fallback_cost(self) -> str:
        """What the fallback is, where it is not torch DDP itself: the runtime on DDP's
        buckets, and what its host time costs over torch DDP's for this model (its tensors and
        the fallback's blocks at the per-tensor and per-block host costs of
        :meth:`usbyte_opt.formats.HostCost.default`, what ``usbyte-opt profile`` measures)."""
        if self.against != DDP_BUCKETS:
            return ""
        host = HostCost.default(str(self.opt.device))
        n, m = self.opt.tensor_count, len(self.fallback.blocks)
        extra = (n * (host.runtime_tensor_us - host.ddp_tensor_us)
                 + m * (host.runtime_block_us - host.ddp_bucket_us)) / 1e3
        hidden = "" if host.launch_bound else ", hidden where the GPU is busier than the host"
        return (f" (the runtime on DDP's buckets, not torch DDP itself: about {extra:.2f} ms "
                f"more host time per iteration than torch DDP for {plural(n, 'tensor')} in "
                f"{plural(m, 'block')}"
                f"{hidden}; usbyte_opt.DistributedDataParallel falls back to torch DDP)")

    # -- later -------------------------------------------------------------------------------

    def _check_drift(self) -> None:
        """Send this window's median; act on the previous window's (every rank the same, at
        the same step)."""
        med = _median(self.timer.take_ready())
        vec = torch.tensor([0.0 if math.isnan(med) else med, 0.0 if math.isnan(med) else 1.0],
                           dtype=torch.float64)
        prev, self.drift_work = self.drift_work, (self.opt.control_all_reduce(vec), vec)
        if prev is None:
            return
        work, got = prev
        if work is not None:   # sent check_every steps ago: arrived long since
            self.opt.wait_host(work, "all-reduce of the drift check")
        total, ranks = got.tolist()
        if ranks < 1:
            return
        med = total / ranks
        self.info["last_measured_ms"] = med
        pred = self.info.get("predicted_ms") if self.info.get("chosen") == "plan" else None
        if not pred or med <= 0:
            return
        off = abs(med - pred) / pred
        if off > DRIFT:
            self.info["drift"] = {"measured_ms": med, "predicted_ms": pred, "relative": off}
            if self.rank == 0 and not self.warned:
                warnings.warn(f"the plan's iterations take {med:.1f} ms, {off:.0%} off its "
                              f"prediction of {pred:.1f} ms: call opt.replan() to plan again",
                              _warning_class(), stacklevel=4)
            self.warned = True
            if self.replan_on_drift:
                self._restart()

    def replan(self) -> None:
        """Plan (auto) or verify again from the next step on (call on every rank)."""
        self.replan_asked = True

    def report(self) -> dict[str, Any]:
        """The figures of :attr:`info` (chosen, measured, predicted, interval), the phase, and
        ``summary``: one line saying what runs and why (:meth:`summary`)."""
        out = dict(self.info)
        if self.phase != "settled" or "summary" not in out:
            out["summary"] = self.summary()
        out["phase"] = self.phase
        out["steps"] = self.steps
        out["schedule"] = {"strategy": self.opt.schedule.strategy, "mode": self.opt.schedule.mode,
                           "blocks": len(self.opt.schedule.blocks)}
        return out


def _possessive(name: str) -> str:
    """``DDP's buckets'`` / ``torch DDP's``."""
    return name + ("'" if name.endswith("s") else "'s")


def _side(window: int) -> str:
    """Which side runs window ``window`` of a verification: ``plan``, ``fallback``, then
    ``fallback``, ``plan``, alternating by round."""
    first_plan = (window // 2) % 2 == 0
    return "plan" if (window % 2 == 0) == first_plan else "fallback"


def _warning_class() -> type:
    from .checks import UsbyteWarning

    return UsbyteWarning
