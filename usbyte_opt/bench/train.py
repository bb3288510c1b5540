"""Real training, timed: PyTorch DDP, PyTorch FSDP2, the runtime with a schedule (all-reduce
or sharded), or no communication at all.

Runs inside an initialised process group, on every rank. Each :class:`Trainee` owns a fresh
copy of the model (seeded with :data:`SEED` before the factory runs, so every trainee starts
from the same weights even when the factory does not seed itself), its
own optimizer, the same sequence of rank-dependent batches and its own random-number state
(:meth:`Trainee.own_rng`: the CPU generator's and, on CUDA, its device's, seeded with the
weights and swapped in around every iteration it runs), so that dropout draws the same masks
in every trainee however their iterations interleave. After the same number of steps every
trainee must hold the same parameters (the runtime's guarantee; DDP is the reference; FSDP2
reduce-scatters, so it may differ in the last bits beyond 2 ranks). With
:data:`DETERMINISTIC_ENV` set, the bench's rank runs deterministic kernels from its start, the
profile included (:func:`deterministic_kernels`, called by ``worker.run_rank``), so that the
comparison can be exact on CUDA too.

Each trainee also reports its optimizer state on this rank (:meth:`Trainee.state_bytes`): the
whole model's under DDP, about ``1 / world_size`` of it under FSDP2 and the runtime's sharded
mode (ZeRO-1).

Timing (:func:`interleave`): an iteration is the time from the start of one forward to the
start of the next, which is what a training loop pays per step in steady state (a forward
that waits for its parameters' all-reduce counts; so does DDP's wait at the end of backward).
Trainees take turns in rounds, the order reversed every other round, so that a slow spell of
the shared machine hits every trainee alike: each turn runs ``warmup`` untimed iterations,
then ``k`` timed ones, then one more whose only purpose is to end the last timed one, then
drains (the runtime's ``synchronize``) and meets the other ranks at a barrier. Each turn is a
window (:attr:`Trainee.windows_ms`): a strategy's turn and DDP's in the same round are a
pair, and rounds are added while a strategy's time against DDP's is not distinguishable
(:mod:`usbyte_opt.verdict`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist

from ..errors import UsbyteError
from ..formats import Schedule
from ..models import build, make_batches
from ..profiler.optimizers import make_optimizer
from ..verdict import Budget

#: Distinct batches each trainee cycles through (rank-dependent, same for every trainee).
BATCHES = 4
#: The seed set before each trainee's model is built.
SEED = 0
#: Set (non-empty, not ``0``) in the ranks' environment: the trainees run deterministic kernels
#: (:func:`deterministic_kernels`). On CUDA, set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` there too,
#: before the process starts (cuBLAS reads it when CUDA initialises).
DETERMINISTIC_ENV = "USBYTE_BENCH_DETERMINISTIC"


def deterministic_kernels() -> None:
    """Deterministic kernels in this process from now on: cuDNN deterministic, its benchmark
    off, TF32 off for matmul and cuDNN, ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` (an op without a deterministic implementation warns rather than stops
    the run; the bench reports the difference it makes). cuBLAS also needs
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment before CUDA initialises, which
    this function cannot do for its own process; it sets it for the processes it starts."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def backend_device(backend: str, cuda_index: int | None = None) -> torch.device:
    """The device a collective's tensors must be on for a group of ``backend`` (what
    ``dist.get_backend`` says): CPU when the backend takes CPU tensors (gloo, MPI, UCC, or a
    per-device backend string with a ``cpu:`` entry), else the CUDA device ``cuda_index``
    (default: the current one), since NCCL takes CUDA tensors only.

    Example::

        >>> backend_device("gloo"), backend_device("cpu:gloo,cuda:nccl")
        (device(type='cpu'), device(type='cpu'))
        >>> backend_device("nccl", 0), backend_device("cuda:nccl", 1)
        (device(type='cuda', index=0), device(type='cuda', index=1))
    """
    b = backend.lower()
    if ":" in b:
        cpu = any(item.split(":", 1)[0].strip() == "cpu" for item in b.split(","))
    else:
        cpu = b != "nccl"
    if cpu:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device() if cuda_index is None else cuda_index)


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device for the tensors of a collective on ``group`` (``None``: the default group):
    the current CUDA device on NCCL, the CPU on gloo (:func:`backend_device`)."""
    return backend_device(str(dist.get_backend(group)))


def fsdp2_missing() -> str | None:
    """Why this torch cannot train FSDP2 (``None`` when it can): ``fully_shard`` is public in
    ``torch.distributed.fsdp`` from torch 2.6 on.

    Example::

        >>> fsdp2_missing() is None or fsdp2_missing().startswith("fsdp2 needs")
        True
    """
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return (f"fsdp2 needs torch.distributed.fsdp.fully_shard (torch >= 2.6); this is torch "
                f"{torch.__version__}")
    return None


def fsdp2_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules :func:`apply_fsdp2` shards on their own, children before parents: the
    blocks, as torch's FSDP2 docs shard each transformer block — every element of an
    ``nn.Sequential`` or ``nn.ModuleList`` anywhere in ``model`` (the layers of a plain
    ``Sequential``, the blocks of a ResNet stage or a transformer's stack) that has
    parameters and shares none with a module outside it (tied weights: FSDP2 cannot shard one
    parameter in two groups, so they stay with an enclosing group, as the docs do for tied
    embeddings). The root is not in the list; what no unit takes is the root's.

    Not every module with parameters of its own: a unit must be *called*, since FSDP2 gathers
    a unit's parameters in its forward pre-hook, and a module may read a child's parameters
    without calling it (``nn.MultiheadAttention`` reads ``out_proj.weight``: sharded alone, it
    fails with "mixed torch.Tensor and DTensor"). A container's elements are called.

    Example::

        >>> lin = torch.nn.Linear
        >>> m = torch.nn.Sequential(lin(3, 3), torch.nn.ReLU(), torch.nn.Sequential(lin(3, 3), lin(3, 3)))
        >>> [type(u).__name__ for u in fsdp2_units(m)]
        ['Linear', 'Linear', 'Sequential', 'Linear']
        >>> m[0].weight = m[2][1].weight      # tied: m[0], m[2][1] and m[2] stay with the root
        >>> [type(u).__name__ for u in fsdp2_units(m)]
        ['Linear']
    """
    inside: dict[int, set[int]] = {}  # a module's id -> ids of the modules in its subtree
    for mod in model.modules():
        inside[id(mod)] = {id(x) for x in mod.modules()}
    owners: dict[int, set[int]] = {}  # a parameter's id -> the modules that hold it
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(mod))
    units = []
    for container in model.modules():
        if not isinstance(container, (torch.nn.Sequential, torch.nn.ModuleList)):
            continue
        for mod in container.children():
            params = list(mod.parameters())
            if params and all(owners[id(p)] <= inside[id(mod)] for p in params):
                units.append(mod)
    units = list({id(u): u for u in units}.values())  # one module in two containers: once
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(units, key=lambda u: -order[id(u)])  # modules() is parents first


def apply_fsdp2(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` sharded by torch's FSDP2 as its docs recommend: ``fully_shard`` on each block
    (:func:`fsdp2_units`), then on the root (which takes every parameter left). One mesh
    over every rank of the default group, on ``device``'s type (gloo on CPU, NCCL on CUDA)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in fsdp2_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` held on this rank: a DTensor's (FSDP2)
    counts its local shard only (``to_local()``).

    The bench reads it after training, and that is the peak: SGD, Adam and AdamW create their
    state at a parameter's first step and only ever update it in place afterwards, so the
    state never shrinks (the optimizers :func:`~usbyte_opt.profiler.make_optimizer` makes).

    Example::

        >>> p = torch.nn.Parameter(torch.zeros(10))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(10); opt.step()
        >>> state_bytes(opt)    # the momentum buffer: 10 float32
        40
    """
    from torch.distributed.tensor import DTensor

    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, DTensor):
                v = v.to_local()
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


class Trainee:
    """One way of training the model: ``"ddp"`` (torch DDP, default buckets), ``"fsdp2"``
    (torch FSDP2, :func:`apply_fsdp2`), ``"runtime"`` (DistributedOptimizer with
    ``schedule``, in the schedule's mode: all-reduce or sharded) or ``"local"`` (no
    communication: the compute reference). All of them with the same optimizer type and
    hyperparameters (:func:`~usbyte_opt.profiler.make_optimizer`).

    Args:
        name: the strategy name it reports under.
        kind: ``ddp``, ``ddp-tuned``, ``fsdp2``, ``runtime`` or ``local``.
        spec: the model spec (built-in name, ``module:factory`` or a factory).
        batch_size: per-rank batch size.
        device: the training device.
        optimizer: ``sgd``, ``adam`` or ``adamw`` (:func:`usbyte_opt.profiler.make_optimizer`).
        schedule: the schedule, or ``"auto"`` (``runtime`` only).
        rank: this rank (selects its batches).
        verify: let the runtime verify the plan against its fallback (``runtime`` only; off by
            default, so that strategies are measured as planned).
        trace: the file the runtime records its measured timeline in (``runtime`` only).
        zero_stage: the runtime's ``zero_stage`` (``runtime`` with a sharded schedule only).
        emulate: ``(spec, link)``, a :class:`~usbyte_opt.collectives.emulate.LinkSpec` and the
            :class:`~usbyte_opt.collectives.emulate.EmulatedLink` its collectives occupy
            (shared by the trainees of a rank, which take turns on it): torch DDP's buckets
            through the link by a communication hook, the runtime's all-reduce blocks by its
            channel's issuer (``ddp``, ``ddp-tuned`` and ``runtime`` with an all-reduce
            schedule; ``local`` ignores it).
    """

    def __init__(self, name: str, kind: str, spec: Any, batch_size: int | None,
                 device: torch.device, optimizer: str, schedule: Schedule | str | None = None,
                 rank: int = 0, verify: bool = False, trace: str | None = None,
                 zero_stage: int = 1, emulate: tuple[Any, Any] | None = None,
                 compile: str | None = None):
        self.name, self.kind = name, kind
        # Every trainee from the same weights, whether or not the factory seeds itself.
        torch.manual_seed(SEED)
        model, inputs, self.loss_fn = build(spec, batch_size, device)
        self.batches = make_batches(inputs, rank, BATCHES)
        # Its own random-number state from here (own_rng): every trainee draws the same
        # dropout masks, whatever runs between its iterations (its wrapper's construction,
        # the other trainees' iterations).
        self._cuda = device if device.type == "cuda" else None
        self._rng_cpu = torch.get_rng_state()
        self._rng_cuda = torch.cuda.get_rng_state(device) if self._cuda is not None else None
        self._rng_held = False
        self.plain = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.model: torch.nn.Module
        self.opt: Any   # a torch optimizer, or the runtime's DistributedOptimizer
        #: The torch DDP module (``ddp``, ``ddp-tuned``), compiled or not.
        self.ddp: Any = None
        if compile is not None:
            if kind == "fsdp2":
                raise UsbyteError(f"{name}: --compile trains torch DDP, the runtime and the "
                                  "local run compiled; not fsdp2")
            from ..runtime.compiled import own_forward

            own_forward(model)

        def compiled(m: torch.nn.Module) -> torch.nn.Module:
            return cast(torch.nn.Module, torch.compile(m, backend=compile)) if compile else m

        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DDP(model, device_ids=ids)
            self.model = compiled(self.ddp)
            self.opt = make_optimizer(optimizer, params)
        elif kind == "ddp-tuned":
            from ..ddp import wrap

            ids = [device.index] if device.type == "cuda" else None
            assert isinstance(schedule, Schedule), "ddp-tuned trains a planned schedule"
            self.ddp = wrap(model, schedule, device_ids=ids)
            self.model = compiled(self.ddp)
            self.opt = make_optimizer(optimizer, params)
        elif kind == "fsdp2":
            missing = fsdp2_missing()
            if missing:
                raise UsbyteError(missing)
            self.model = apply_fsdp2(model, device)
            # fully_shard swapped the parameters for DTensor shards: the optimizer takes those.
            self.opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
        elif kind == "runtime":
            from ..runtime import DistributedOptimizer

            self.model = compiled(model)
            # (Compiled: the plan's pieces under any backend, as planned; the report says how
            # far training ended from DDP's.)
            self.opt = DistributedOptimizer(make_optimizer(optimizer, params), self.model,
                                            schedule=schedule, verify=verify, trace=trace,
                                            zero_stage=zero_stage,
                                            accept_compiled_rounding=compile is not None)
        elif kind == "local":
            self.model = compiled(model)
            self.opt = make_optimizer(optimizer, params)
        else:
            raise ValueError(f"kind: expected ddp, ddp-tuned, fsdp2, runtime or local, got {kind!r}")
        if emulate is not None and kind != "local":
            self._emulate(kind, schedule, *emulate)
        self.steps = 0
        self._losses: list[torch.Tensor] = []
        self.durations_ms: list[float] = []
        #: Each turn's timed iterations (ms), in order: the windows of the comparisons.
        self.windows_ms: list[list[float]] = []
        #: Bytes this rank's node sent on the lab's link during this trainee's turns, and the
        #: iterations those turns ran (:func:`turn` with ``link``).
        self.link_bytes = 0
        self.link_iterations = 0

    def _emulate(self, kind: str, schedule: Schedule | str | None, spec: Any, link: Any) -> None:
        """Send this trainee's collectives through the emulated ``link`` (see the class)."""
        from ..collectives.emulate import EmulatedHookState, emulated_allreduce_hook, install_on_channel
        from ..formats import Mode

        if kind in ("ddp", "ddp-tuned"):
            self.ddp.register_comm_hook(EmulatedHookState(spec, link=link), emulated_allreduce_hook)
        elif kind == "runtime" and isinstance(schedule, Schedule) and schedule.mode != Mode.SHARDED \
                and not schedule.hierarchical:
            install_on_channel(self.opt._chan, spec, link)
        else:
            raise UsbyteError(f"{self.name}: an emulated link carries torch DDP's buckets and the "
                              "runtime's plain all-reduce blocks only")

    @contextmanager
    def own_rng(self) -> Iterator[None]:
        """This trainee's random-number state in force inside (the CPU generator's and, on
        CUDA, its device's): restored on entry, saved on exit. Nested uses swap nothing.

        Each trainee keeps the state it had once its model was built (:data:`SEED`), so that
        every trainee draws the same sequence of dropout masks however their iterations
        interleave, and trains to the same parameters as the others."""
        if self._rng_held:
            yield
            return
        torch.set_rng_state(self._rng_cpu)
        if self._cuda is not None and self._rng_cuda is not None:
            torch.cuda.set_rng_state(self._rng_cuda, self._cuda)
        self._rng_held = True
        try:
            yield
        finally:
            self._rng_held = False
            self._rng_cpu = torch.get_rng_state()
            if self._cuda is not None:
                self._rng_cuda = torch.cuda.get_rng_state(self._cuda)

    def iteration(self) -> None:
        """One training step (forward, backward, ``step()``, ``zero_grad()``) on the next
        batch, under this trainee's own random-number state (:meth:`own_rng`)."""
        if self._rng_held:
            self._iteration()
            return
        with self.own_rng():
            self._iteration()

    def _iteration(self) -> None:
        x = self.batches[self.steps % len(self.batches)]
        loss = self.loss_fn(self.model(*x))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self._losses.append(loss.detach())  # read later: float() would wait for the GPU
        self.steps += 1

    @property
    def losses(self) -> list[float]:
        """Every iteration's loss so far."""
        return [float(x) for x in self._losses]

    def settled(self) -> bool:
        """Whether the runtime has finished planning and verifying (always, for the others)."""
        return self.kind != "runtime" or self.opt.report().get("phase", "settled") == "settled"

    def report(self) -> dict[str, Any] | None:
        """The runtime's report (``DistributedOptimizer.report()``); ``None`` for the others."""
        return self.opt.report() if self.kind == "runtime" else None

    def record_trace(self, on: bool) -> None:
        """Turn the runtime's measured timeline on or off (a runtime with a trace file only)."""
        if self.kind == "runtime":
            self.opt.record_trace(on)

    def drain(self) -> None:
        """Finish pending communication and updates (the runtime's lazy updates)."""
        if self.kind == "runtime":
            self.opt.synchronize()

    def parameters(self) -> torch.Tensor:
        """Every trainable parameter, flattened (after :meth:`drain`). FSDP2's are gathered
        whole from their shards (``full_tensor()``, a collective: every rank calls this for
        the same trainees in the same order)."""
        from torch.distributed.tensor import DTensor

        return torch.cat([(cast(Any, p.detach()).full_tensor() if isinstance(p, DTensor) else p.detach())
                          .reshape(-1).float().cpu()
                          for p in self.plain.parameters() if p.requires_grad])

    def state_bytes(self) -> int:
        """This rank's optimizer-state bytes (:func:`state_bytes`, the peak after training):
        of the user's optimizer object, the one the runtime wraps (``opt.optimizer``; in
        sharded mode it holds this rank's shards only), for the others of their optimizer
        (FSDP2: the local shards of its DTensor state)."""
        return state_bytes(self.opt.optimizer if self.kind == "runtime" else self.opt)


#: Iterations of the untimed pass in which a runtime with a trace file records its timeline.
TRACED = 10

#: Iterations a planning or verifying runtime may take to settle before it is timed.
SETTLE_CAP = 120


def turn(t: Trainee, warmup: int, timed: int, device: torch.device,
         link: Callable[[], int] | None = None) -> None:
    """One turn of ``t``: untimed warm-up, ``timed`` timed iterations, drain, barrier.

    An iteration's time is from its start to the next one's, in steady state. On CUDA the
    stamps are events on the current stream, read after the turn: a host synchronize per
    iteration would wait for NCCL as well and turn the runtime's overlap into a fence. With
    ``link`` (a byte counter of this node's link), the bytes sent during the turn and its
    iterations are added to ``t.link_bytes`` and ``t.link_iterations``.

    The whole turn runs under the trainee's own random-number state (:meth:`Trainee.own_rng`,
    swapped once per turn, not inside the timed iterations)."""
    sent = link() if link is not None else 0
    with t.own_rng():
        for _ in range(warmup):
            t.iteration()
        if device.type == "cuda":
            events = []
            for _ in range(timed + 1):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.current_stream(device))
                events.append(ev)
                t.iteration()
            t.drain()
            torch.cuda.synchronize(device)
            new = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        else:
            stamps = []
            for _ in range(timed + 1):
                stamps.append(time.perf_counter())
                t.iteration()
            t.drain()
            new = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    t.durations_ms += new
    t.windows_ms.append(new)
    dist.barrier()
    if link is not None:
        t.link_bytes += link() - sent
        t.link_iterations += warmup + timed + 1


def interleave(trainees: Sequence[Trainee], iterations: int, rounds: int, warmup: int,
               device: torch.device, first_warmup: int = 3,
               progress: Callable[[str], None] | None = None, traced: int = 0,
               against: str | None = None, budget: Budget | None = None,
               link: Callable[[], int] | None = None) -> None:
    """Time ``iterations`` steady-state iterations of every trainee, in ``rounds`` turns each,
    and more turns while a comparison with ``against`` is not distinguishable.

    Every trainee first runs ``first_warmup`` iterations once (DDP rebuilds its buckets after
    the first, the runtime learns its hooks' order in it); then, round after round, each takes
    a turn of ``warmup`` untimed and ``ceil(iterations / rounds)`` timed iterations (fewer in
    the last round, so the total is ``iterations``), the order reversed every other round.
    With ``against`` (a trainee's name, DDP) and ``budget``: every other trainee but
    ``no-comm`` is compared with it in paired windows (:mod:`usbyte_opt.verdict`, on each
    window's median, mean over the ranks, so every rank holds the same figures and goes on or
    stops alike); while a comparison's interval contains 1, rounds of ``ceil(iterations /
    rounds)`` are added for the undecided trainees and ``against``, as
    :meth:`~usbyte_opt.verdict.Budget.more` says (``budget.max_pairs`` rounds at most,
    ``budget.max_s`` seconds of timed rounds), and the others then catch up untimed, so that
    every trainee ends after as many steps. Runtimes with a trace file record their
    measured timeline only in a last, untimed pass of ``traced`` iterations that every trainee
    runs (recording costs the host time in the hooks, which DDP's timed iterations do not pay).
    ``link``: a byte counter of this node's link, read around every turn (:func:`turn`).
    """
    for t in trainees:
        t.record_trace(False)
    for t in trainees:
        for _ in range(first_warmup):
            t.iteration()
    # A runtime that plans or verifies in the run does so before it is timed (every rank
    # settles at the same iteration); every trainee runs as many iterations, so that their
    # parameters stay comparable.
    extra = 0
    while not all(t.settled() for t in trainees) and extra < SETTLE_CAP:
        for t in trainees:
            t.iteration()
        extra += 1
    for t in trainees:
        t.drain()
        dist.barrier()
    rounds = max(1, min(rounds, iterations))
    per = -(-iterations // rounds)
    base = next((t for t in trainees if t.name == against), None) if budget is not None else None
    compared = [t for t in trainees if base is not None and t is not base and t.kind != "local"]
    most = max(rounds, budget.max_pairs) if budget is not None and compared else rounds
    budget = budget if compared else None
    active = list(trainees)
    agreed: dict[str, list[float]] = {t.name: [] for t in trainees}
    left = iterations
    t0 = time.perf_counter()
    for r in range(most):
        k = min(per, left) if r < rounds else per
        left -= k
        if k <= 0:
            break
        label = f"{r + 1}/{rounds}" if r < rounds else f"{r + 1} (added: not yet distinguishable from {against})"
        for t in (active if r % 2 == 0 else active[::-1]):
            if progress:
                progress(f"round {label}: {t.name}")
            turn(t, warmup, k, device, link)
        if budget is None or base is None:
            continue
        # This round's window medians and the time so far, mean over the ranks (on the
        # default group's device: NCCL takes no CPU tensor).
        vec = torch.tensor([_median(t.windows_ms[-1]) for t in active]
                           + [time.perf_counter() - t0], dtype=torch.float64, device=group_device())
        dist.all_reduce(vec)
        vals = (vec / dist.get_world_size()).tolist()
        for t, v in zip(active, vals):
            agreed[t.name].append(v)
        pending = [t for t in compared if t in active]
        ratios = {t.name: budget.compare(agreed[base.name][:len(agreed[t.name])], agreed[t.name])
                  for t in pending}
        if r + 1 >= rounds and not budget.more(r + 1, vals[-1], *ratios.values()):
            break
        if r + 1 >= rounds and r + 1 in budget.looks():   # the decided ones are done
            active = [t for t in active if t is base or (t in compared and
                                                         not ratios[t.name].distinguishable)]
    # Those that sat out added rounds catch up, untimed: every trainee ends after as many
    # steps on the same batches, so that their parameters stay comparable.
    most_steps = max(t.steps for t in trainees)
    for t in trainees:
        while t.steps < most_steps:
            t.iteration()
        t.drain()
    dist.barrier()
    if traced > 0:
        for t in trainees:
            t.record_trace(True)
            for _ in range(traced):
                t.iteration()
            t.drain()
            t.record_trace(False)
            dist.barrier()


def _median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    if not ys:
        return math.nan
    k = len(ys) // 2
    return ys[k] if len(ys) % 2 else 0.5 * (ys[k - 1] + ys[k])


__all__ = ["BATCHES", "DETERMINISTIC_ENV", "TRACED", "Trainee", "apply_fsdp2", "backend_device",
           "deterministic_kernels", "fsdp2_missing", "fsdp2_units", "group_device", "interleave",
           "state_bytes", "turn"]
