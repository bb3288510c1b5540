"""An emulated interconnect: real compute, a modelled link.

A cluster cannot always be had, and one GPU cannot run NCCL between ranks. This module keeps
the training real and emulates only the link: the job trains at world size 1, every
collective still runs (an identity at world size 1, so every number is the real one), and
each also occupies **one serial emulated channel** for the time the modelled link would take,
asynchronously and in issue order, as NCCL's stream runs collectives one after another.

The model (:class:`LinkSpec`, written ``NxRATE[@ALPHA]`` and read by :func:`parse_emulate`):
``N`` ranks on a ring whose every link carries ``RATE``; a collective of ``b`` bytes per rank
costs ``alpha + ring_bytes / rate`` with

* all-reduce: ``ring_bytes = 2 (N-1)/N * b`` (a reduce-scatter then an all-gather);
* reduce-scatter, all-gather: ``ring_bytes = (N-1)/N * b`` each (``b``: the whole block).

``alpha`` is the fixed cost of one collective (launch, handshakes, the ring's per-step
latencies together); :data:`DEFAULT_ALPHA_S` (50 µs) when the spec gives none, in the range
of a small NCCL all-reduce over a few nodes of Ethernet or InfiniBand. For a TCP ring of many
nodes it is larger (about ``2 (N-1)`` times one hop's latency): give it, ``64x10gbit@800us``.

The channel (:class:`EmulatedLink`) is busy for each submission's seconds, starting when the
previous submission finished, or when it was submitted if the channel was idle, or when the
real collective it follows completed, whichever is last; a work (:class:`EmulatedWork`)
completes when its real collective and its time on the channel both have.

* On the host (CPU tensors): one worker thread and a queue. Each submission's end is
  scheduled from the previous one's *scheduled* end, so a late wake-up never accumulates;
  the thread sleeps until about :data:`SPIN_S` before the end, then spins on
  ``time.perf_counter``, so sub-millisecond times come out right to a few tens of µs on an
  idle machine. The thread shares the cores (and the GIL) with the training: on a loaded
  machine a completion may be seen late (up to Python's switch interval, 5 ms), never early.
* On CUDA: a side stream per link, each submission a ``torch.cuda._sleep`` kernel of the
  submission's cycles (cycles per second calibrated once per process and device with CUDA
  events), queued after the work the current stream had queued at submission and after the
  real collective (``work.wait()``, a stream wait on NCCL); waiting makes the current stream
  wait for an event recorded after the sleep, with no host synchronisation. What is not
  emulated: NCCL's kernels occupy several SMs (one CTA per channel) and slow the compute
  kernels they run beside, and copy engines and PCIe/NVLink bandwidth are shared; the sleep
  occupies one CTA of one SM, so that contention is only approximated (by the little the
  sleep takes, and by the real single-rank collective). ``ctas`` is reserved for occupying
  more SMs and accepts only 1 today. ``_sleep`` counts SM clock cycles: a clock that changes
  after calibration (boost, throttling) scales the emulated times with it.

Neither emulates congestion, a second job on the network, stragglers, or failures; a real
multi-rank run remains the judge. At world size 1 the real collective moves no data, so the
emulated time is all the link costs; at larger world sizes the emulation adds to the real
link's time.

Three ways in: :func:`emulated_allreduce_hook` (a DDP communication hook, DDP's default one
plus the link), :func:`emulated_sum_issuer` (wraps the issuer of the runtime's blocks) and
:func:`install_on_channel` (puts that issuer on a runtime channel). Example (no process group
needed for the link itself)::

    >>> spec = parse_emulate("8x1gbit@50us")
    >>> round(spec.allreduce_s(25_000_000), 6)    # 25 MB: 2 * 7/8 * 25e6 B / 125e6 B/s + alpha
    0.35005
    >>> with EmulatedLink() as link:
    ...     works = [link.submit(0.002) for _ in range(3)]
    ...     works[-1].wait(), all(w.is_completed() for w in works)
    (True, True)
"""

from __future__ import annotations

import math
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UsageError, UsbyteError

#: Alpha (seconds) of a spec that gives none: the fixed cost of one collective.
DEFAULT_ALPHA_S = 50e-6

#: The host link sleeps until this long before a submission's end, then spins (seconds).
SPIN_S = 200e-6

#: Cycles of each calibration sleep on CUDA (a few milliseconds on any recent GPU).
CALIBRATION_CYCLES = 10_000_000

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"ns": 1e9, "us": 1e6, "µs": 1e6, "ms": 1e3, "s": 1.0}   # per second
_SPEC = re.compile(r"(\d+)\s*x\s*(\d*\.?\d+(?:e[+-]?\d+)?)\s*([kmgt]?bit)(?:/s)?"
                   r"(?:\s*@\s*(\d*\.?\d+(?:e[+-]?\d+)?)\s*(ns|us|µs|ms|s))?")
_EXPECTED = ("expected RANKSxRATE[@ALPHA] such as 8x1gbit, 16x25gbit or 8x1gbit@50us "
             "(RATE in bit, kbit, mbit, gbit or tbit per second; ALPHA in us, ms or s; "
             f"default alpha {DEFAULT_ALPHA_S * 1e6:g}us)")

#: The collectives of :meth:`LinkSpec.collective_s`, by the names the issuers use.
KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def _fmt_rate(bps: float) -> str:
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps >= _RATE_UNITS[unit]:
            return f"{bps / _RATE_UNITS[unit]:.6g}{unit}"
    return f"{bps:.6g}bit"


@dataclass(frozen=True)
class LinkSpec:
    """A modelled interconnect: ``ranks`` on a ring, ``bytes_per_s`` per link, ``alpha_s``
    fixed seconds per collective (see the module's text). ``str()`` gives it back in
    :func:`parse_emulate`'s form.

    Example::

        >>> s = LinkSpec(ranks=4, bytes_per_s=1e9, alpha_s=0.0)
        >>> s.allreduce_s(4e9), s.reduce_scatter_s(4e9), s.all_gather_s(4e9)
        (6.0, 3.0, 3.0)
        >>> str(LinkSpec(8, 125e6, 50e-6))
        '8x1gbit@50us'
    """

    ranks: int
    bytes_per_s: float
    alpha_s: float = DEFAULT_ALPHA_S

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 2:
            raise UsbyteError(f"emulated link: ranks: expected an integer >= 2, got {self.ranks!r}")
        if not (isinstance(self.bytes_per_s, (int, float)) and math.isfinite(self.bytes_per_s)
                and self.bytes_per_s > 0):
            raise UsbyteError(f"emulated link: bytes_per_s: expected a finite number > 0, got "
                              f"{self.bytes_per_s!r}")
        if not (isinstance(self.alpha_s, (int, float)) and math.isfinite(self.alpha_s)
                and self.alpha_s >= 0):
            raise UsbyteError(f"emulated link: alpha_s: expected a finite number >= 0, got "
                              f"{self.alpha_s!r}")

    def __str__(self) -> str:
        return f"{self.ranks}x{_fmt_rate(self.bytes_per_s * 8)}@{self.alpha_s * 1e6:.6g}us"

    def ring_bytes(self, kind: str, nbytes: float) -> float:
        """Bytes each rank sends for a ``kind`` collective (one of :data:`KINDS`) of a block of
        ``nbytes`` bytes: ``2(N-1)/N * nbytes`` for an all-reduce, ``(N-1)/N * nbytes`` for
        the others."""
        if kind not in KINDS:
            raise UsbyteError(f"collective {kind!r}: expected one of {'|'.join(KINDS)}")
        if not nbytes >= 0:
            raise UsbyteError(f"emulated link: block size: expected bytes >= 0, got {nbytes!r}")
        share = (self.ranks - 1) / self.ranks
        return (2 * share if kind == "all-reduce" else share) * nbytes

    def collective_s(self, kind: str, nbytes: float) -> float:
        """Seconds the link is busy for a ``kind`` collective (one of :data:`KINDS`) of a
        block of ``nbytes`` bytes: ``alpha_s + ring_bytes / bytes_per_s``."""
        return self.alpha_s + self.ring_bytes(kind, nbytes) / self.bytes_per_s

    def allreduce_s(self, nbytes: float) -> float:
        """Seconds of an all-reduce of ``nbytes`` bytes: ``alpha + 2(N-1)/N * nbytes / rate``."""
        return self.collective_s("all-reduce", nbytes)

    def reduce_scatter_s(self, nbytes: float) -> float:
        """Seconds of a reduce-scatter of a block of ``nbytes`` bytes (each rank keeps
        ``1/N`` of it): ``alpha + (N-1)/N * nbytes / rate``."""
        return self.collective_s("reduce-scatter", nbytes)

    def all_gather_s(self, nbytes: float) -> float:
        """Seconds of an all-gather into a block of ``nbytes`` bytes (each rank gives ``1/N``
        of it): ``alpha + (N-1)/N * nbytes / rate``."""
        return self.collective_s("all-gather", nbytes)


def parse_emulate(spec: str, what: str = "--emulate") -> LinkSpec:
    """The :class:`LinkSpec` written ``NxRATE[@ALPHA]``: ``N`` ranks (at least 2), a link rate
    in bits per second as tc writes it (``200mbit``, ``1gbit``, ``25gbit``, ``1.6tbit``; an
    optional ``/s``, any case; bytes are refused, too easily misread) and an optional alpha
    (``@50us``, ``@0.2ms``; :data:`DEFAULT_ALPHA_S` when omitted). ``what`` names the value
    in the error.

    Raises:
        UsageError: (a :class:`~usbyte_opt.errors.UsbyteError`) one line naming the value and
        what was expected.

    Example::

        >>> parse_emulate("8x1gbit")
        LinkSpec(ranks=8, bytes_per_s=125000000.0, alpha_s=5e-05)
        >>> parse_emulate("4x200mbit@20us")
        LinkSpec(ranks=4, bytes_per_s=25000000.0, alpha_s=2e-05)
        >>> parse_emulate("8x1GB")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsageError: --emulate '8x1GB': expected RANKSxRATE[@ALPHA] such as 8x1gbit, ...
    """
    text = str(spec)
    m = _SPEC.fullmatch(text.strip().lower())
    if not m:
        raise UsageError(f"{what} {text!r}: {_EXPECTED}")
    ranks = int(m.group(1))
    if ranks < 2:
        raise UsageError(f"{what} {text!r}: expected at least 2 ranks, got {ranks}")
    bps = float(m.group(2)) * _RATE_UNITS[m.group(3)]
    if not (math.isfinite(bps) and bps > 0):
        raise UsageError(f"{what} {text!r}: expected a finite link rate above 0")
    alpha = DEFAULT_ALPHA_S if m.group(4) is None else float(m.group(4)) / _TIME_UNITS[m.group(5)]
    if not math.isfinite(alpha):
        raise UsageError(f"{what} {text!r}: expected a finite alpha")
    return LinkSpec(ranks, bps / 8, alpha)


# ------------------------------------------------------------------------------------------
# The channel and its works
# ------------------------------------------------------------------------------------------

_UNSET: Any = object()
#: Futures of every kind: ``torch.futures.Future`` and what ``then()`` returns (its C++ base).
_Future: Any = torch._C.Future


def _seconds(timeout: timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class EmulatedWork:
    """A collective with its emulated link time: what :meth:`EmulatedLink.submit` returns,
    usable where the runtime uses a ``torch.distributed.Work``.

    ``wait(timeout=None)`` (seconds or a ``timedelta``): on the host link, blocks until the
    real collective and the link time are done, then waits for the real work itself (any
    finishing it does on ``wait``, in the caller's thread), and returns ``True``; a timeout,
    or the real collective's failure, raises ``RuntimeError``, as a gloo work does. On CUDA
    it makes the current stream wait for the link (no host wait; ``timeout`` unused, as for
    NCCL). ``is_completed()`` says whether both are done, without waiting. ``get_future()``
    is a ``torch.futures.Future`` completed, at the same moment, with the value given to
    :meth:`~EmulatedLink.submit`, or else the real work's (its future's) value, or ``None``.
    ``exception()`` is ``None`` unless the real collective failed.

    ``start_s``, ``end_s``: when its link time was scheduled to begin and end (host link,
    ``time.perf_counter`` seconds; ``None`` until then). ``seconds``: its link time.

    Example::

        >>> with EmulatedLink() as link:
        ...     w = link.submit(0.001, value="done")
        ...     w.wait(), w.is_completed(), w.get_future().wait(), w.exception()
        (True, True, 'done', None)
    """

    __slots__ = ("seconds", "start_s", "end_s", "_inner", "_event", "_error", "_future",
                 "_device", "_end_event")

    def __init__(self, seconds: float, inner: Any = None, future: torch.futures.Future | None = None,
                 device: torch.device | None = None, end_event: Any = None):
        self.seconds = seconds
        self.start_s: float | None = None
        self.end_s: float | None = None
        self._inner = inner
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = future if future is not None else torch.futures.Future()
        self._device = device
        self._end_event = end_event

    def _finish(self, value: Any, error: BaseException | None) -> None:
        """The host link's worker: the link time (or the real collective's failure) is over."""
        self._error = error
        self._event.set()
        if error is None:
            self._future.set_result(value)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Wait for the real collective and the link time (see the class's text)."""
        if self._end_event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._end_event)
            return True
        secs = _seconds(timeout)
        if not self._event.wait(secs):
            raise RuntimeError(f"emulated link: timed out after {int((secs or 0) * 1000)} ms "
                               f"(a collective of {self.seconds * 1e3:.3f} ms on the link)")
        if self._error is not None:
            if isinstance(self._error, RuntimeError):
                raise self._error
            raise RuntimeError(str(self._error)) from self._error
        inner = self._inner
        if inner is not None and not isinstance(inner, _Future):
            inner.wait()   # done already: whatever finishing it does on wait, here
        return True

    def is_completed(self) -> bool:
        """Whether the real collective and the link time are both done (no wait)."""
        if self._end_event is not None:
            return bool(self._end_event.query())
        return self._event.is_set()

    def get_future(self) -> torch.futures.Future:
        """A future completed when :meth:`is_completed` becomes true (see the class's text)."""
        return self._future

    def exception(self) -> BaseException | None:
        """The real collective's failure, or ``None``."""
        return self._error


def _value_of(inner: Any) -> Any:
    """The value of a completed real collective: a future's, or its work's future's, or None."""
    if inner is None:
        return None
    if isinstance(inner, _Future):
        return inner.value()
    try:
        return inner.get_future().value()
    except Exception:  # noqa: BLE001 - a work without a future (or an event): no value
        return None


def _sleep_until(t: float) -> None:
    """Sleep until ``time.perf_counter() >= t``: a sleep to :data:`SPIN_S` before, then a spin."""
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        if left > SPIN_S:
            time.sleep(left - SPIN_S)
        else:
            while time.perf_counter() < t:
                pass
            return


class _HostChannel:
    """The host link: a worker thread runs the submissions in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._end = 0.0   # the scheduled end of the last submission
        self._thread = threading.Thread(target=self._run, name="usbyte-emulated-link", daemon=True)
        self._thread.start()

    def submit(self, seconds: float, work: Any, value: Any) -> EmulatedWork:
        ew = EmulatedWork(seconds, work)
        ready: list[float] = []
        fut = work if isinstance(work, _Future) else None
        if work is not None and fut is None:
            try:
                fut = work.get_future()
            except Exception:  # noqa: BLE001 - a work without a future: waited for instead
                fut = None
        if fut is not None:
            # When the real collective completed, as near as can be seen (inline if it has).
            fut.add_done_callback(lambda _f: ready.append(time.perf_counter()))
        self._queue.put((ew, work, fut, value, time.perf_counter(), ready))
        return ew

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ew, work, fut, value, submitted, ready = item
            try:
                t_ready = submitted
                if work is not None:
                    if fut is not None:
                        fut.wait()
                    else:
                        work.wait()
                    t_ready = max(submitted, ready[0] if ready else time.perf_counter())
                start = max(self._end, t_ready)
                end = start + ew.seconds
                self._end = end
                ew.start_s, ew.end_s = start, end
                _sleep_until(end)
                if value is _UNSET:
                    value = _value_of(fut if fut is not None else work)
            except BaseException as e:  # noqa: BLE001 - the real collective failed: the work says so
                ew._finish(None, e)
                continue
            try:
                ew._finish(value, None)
            except BaseException:  # noqa: BLE001 - a caller's future callback: not the link's
                pass

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


#: Calibrated ``torch.cuda._sleep`` cycles per second, by CUDA device index.
_CYCLES_PER_S: dict[int, float] = {}


def cuda_cycles_per_s(device: torch.device | int | str | None = None) -> float:
    """Cycles of ``torch.cuda._sleep`` per second on a CUDA device, measured once per process
    (with CUDA events, on a stream of its own: two sleeps of ``n`` and ``3n`` cycles, so that
    the launch overhead cancels) and kept."""
    if isinstance(device, int):
        idx = device
    else:
        dev = torch.device("cuda") if device is None else torch.device(device)
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx in _CYCLES_PER_S:
        return _CYCLES_PER_S[idx]
    n = CALIBRATION_CYCLES
    with torch.cuda.device(idx):
        stream = torch.cuda.Stream(idx)
        cps = 0.0
        with torch.cuda.stream(stream):
            for _ in range(2):   # the first round loads the kernel and wakes the clocks
                e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                e0.record(stream)
                torch.cuda._sleep(n)
                e1.record(stream)
                torch.cuda._sleep(3 * n)
                e2.record(stream)
                e2.synchronize()
                t1, t2 = e0.elapsed_time(e1) / 1e3, e1.elapsed_time(e2) / 1e3
                cps = 2 * n / (t2 - t1) if t2 > t1 else 3 * n / t2
    if not (math.isfinite(cps) and cps > 0):
        raise UsbyteError(f"emulated link: could not calibrate torch.cuda._sleep on cuda:{idx}")
    _CYCLES_PER_S[idx] = cps
    return cps


class _StreamChannel:
    """The CUDA link: a side stream of calibrated sleeps (see the module's text)."""

    def __init__(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", idx)
        self.stream = torch.cuda.Stream(self.device)
        self.cycles_per_s = cuda_cycles_per_s(self.device)

    def submit(self, seconds: float, work: Any, value: Any) -> EmulatedWork:
        with torch.cuda.device(self.device):
            # After what the current stream has queued (the block's gradients) ...
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(ready)
            end = torch.cuda.Event()
            fut: torch.futures.Future = torch.futures.Future(devices=[self.device])
            cycles = int(round(seconds * self.cycles_per_s))
            with torch.cuda.stream(self.stream):
                if work is not None:
                    # ... and after the real collective: on NCCL (a work or its future) the
                    # side stream waits for it, not the host, nor the compute stream.
                    work.wait()
                if value is _UNSET:
                    value = _value_of(work)
                if cycles > 0:
                    torch.cuda._sleep(cycles)
                end.record(self.stream)
                # A CUDA-aware future: its waiters' streams wait for the sleep, the host does not.
                fut.set_result(value)
        return EmulatedWork(seconds, work, fut, self.device, end)

    def close(self) -> None:
        self.stream.synchronize()


class EmulatedLink:
    """One serial emulated channel (see the module's text): on the host for ``device`` CPU
    (or any device but CUDA), on a CUDA side stream for a CUDA ``device``.

    Args:
        device: the device of the tensors whose collectives go through it.
        ctas: reserved (SMs a collective would occupy); only ``None`` or 1.

    ``submitted_s`` is the sum of the seconds submitted so far, ``count`` their number.
    :meth:`close` (or leaving a ``with`` block) waits for what was submitted and ends the
    worker thread.

    Example::

        >>> import time
        >>> with EmulatedLink("cpu") as link:
        ...     t0 = time.perf_counter()
        ...     a, b = link.submit(0.005), link.submit(0.005)
        ...     _ = b.wait()
        ...     elapsed = time.perf_counter() - t0
        >>> elapsed >= 0.0099, a.end_s <= b.start_s, link.count
        (True, True, 2)
    """

    def __init__(self, device: torch.device | str = "cpu", *, ctas: int | None = None):
        if ctas not in (None, 1):
            raise UsbyteError(f"emulated link: ctas: expected 1 (more is reserved), got {ctas!r}")
        self.device = torch.device(device)
        self.ctas = 1
        self.submitted_s = 0.0
        self.count = 0
        self._closed = False
        self._lock = threading.Lock()
        self._impl: _HostChannel | _StreamChannel = (
            _StreamChannel(self.device) if self.device.type == "cuda" else _HostChannel())

    def submit(self, seconds: float, work: Any = None, value: Any = _UNSET) -> EmulatedWork:
        """Occupy the link for ``seconds``, after the previous submission and after ``work``
        (the real collective: a ``torch.distributed.Work``, anything with ``wait()``, or a
        ``torch.futures.Future``) completes. The returned work's future completes with
        ``value`` when given, else with ``work``'s value (see :class:`EmulatedWork`)."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise UsbyteError(f"emulated link: seconds: expected a finite number >= 0, got {seconds!r}")
        with self._lock:
            if self._closed:
                raise UsbyteError("emulated link: submit() after close(): create a new link")
            self.submitted_s += seconds
            self.count += 1
            return self._impl.submit(float(seconds), work, value)

    def close(self) -> None:
        """Wait for the submissions in flight and stop the channel (again: nothing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._impl.close()

    def __enter__(self) -> EmulatedLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------
# DDP's communication hook
# ------------------------------------------------------------------------------------------


@dataclass
class EmulatedHookState:
    """The state of :func:`emulated_allreduce_hook`: the modelled link, the process group
    (``None``: the default one, as DDP's default hook takes it), and the link, made at the
    first bucket on the bucket's device unless given. :meth:`close` closes it.

    Example (plain prose): ``ddp.register_comm_hook(EmulatedHookState(parse_emulate("8x1gbit")),
    emulated_allreduce_hook)``.
    """

    spec: LinkSpec
    process_group: dist.ProcessGroup | None = None
    link: EmulatedLink | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def link_for(self, device: torch.device) -> EmulatedLink:
        """The link (made on ``device`` at the first call)."""
        with self._lock:
            if self.link is None:
                self.link = EmulatedLink(device)
            return self.link

    def close(self) -> None:
        """Close the link (once nothing is in flight: after the last backward)."""
        if self.link is not None:
            self.link.close()


def emulated_allreduce_hook(state: EmulatedHookState,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default communication hook (``default_hooks.allreduce_hook``: the bucket divided
    by the group's size, then summed by ``all_reduce``; the same values, bitwise) with the
    emulated link: the returned future completes, with the averaged bucket, once the real
    all-reduce has and the link has carried the bucket (``state.spec.allreduce_s`` of its
    bytes, in bucket order after the buckets before it).

    Register it as any hook: ``ddp.register_comm_hook(state, emulated_allreduce_hook)``.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    # As default_hooks._allreduce_fut: the division first (no overflow in fp16), then the sum.
    buf.div_(group.size())  # type: ignore[union-attr]
    real = (dist.all_reduce(buf, group=group, async_op=True)
            .get_future()  # type: ignore[union-attr]
            .then(lambda fut: fut.value()[0]))
    seconds = state.spec.allreduce_s(buf.numel() * buf.element_size())
    return state.link_for(buf.device).submit(seconds, real).get_future()


# DDP checks a hook's annotations as objects; this module's are strings (postponed evaluation).
emulated_allreduce_hook.__annotations__.update(
    {"state": EmulatedHookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


# ------------------------------------------------------------------------------------------
# The runtime's blocks
# ------------------------------------------------------------------------------------------


def emulated_sum_issuer(inner: Callable[[torch.Tensor], Any], link: EmulatedLink,
                        spec: LinkSpec) -> Callable[[torch.Tensor], EmulatedWork]:
    """An issuer of the runtime's blocks (as :func:`~usbyte_opt.collectives.issuers.sum_issuer`'s)
    that issues the real sum all-reduce through ``inner`` and returns an :class:`EmulatedWork`
    whose ``wait()`` and ``is_completed()`` also cover the block's time on ``link``
    (``spec.allreduce_s`` of its bytes). Its ``get_future()`` completes with the real work's
    value, when both are done.

    Example::

        >>> class Done:                       # a real collective that is already over
        ...     def wait(self, timeout=None): return True
        >>> with EmulatedLink() as link:
        ...     issue = emulated_sum_issuer(lambda x: Done(), link, parse_emulate("4x1gbit@0us"))
        ...     w = issue(torch.zeros(1000))      # 4000 B: 1.5 * 4000 / 125e6 s = 48 us
        ...     w.wait(), round(w.seconds * 1e6, 3)
        (True, 48.0)
    """
    def issue(x: torch.Tensor) -> EmulatedWork:
        work = inner(x)
        return link.submit(spec.allreduce_s(x.numel() * x.element_size()), work)

    issue.emulated = True  # type: ignore[attr-defined]
    return issue


def install_on_channel(chan: Any, spec: LinkSpec, link: EmulatedLink | None = None) -> EmulatedLink:
    """Put :func:`emulated_sum_issuer` on a runtime channel
    (:class:`~usbyte_opt.runtime.comm.Channel`: a ``DistributedOptimizer``'s ``_chan``) and
    return its link: ``link`` when given (one channel shared with other trainers, which take
    turns on it), else a new one on the channel's device; close it after the optimizer.

    Call it before the channel's first block is issued (after constructing the optimizer,
    before the first backward): a block issued before it is not emulated, and a work issued
    before it may complete out of order with the link's. Only the channel's plain blocks are
    emulated: hierarchical blocks and sharded mode's reduce-scatters and all-gathers go
    through issuers of their own, and control messages are not blocks.
    """
    issue = getattr(chan, "_issue", None)
    if issue is None or not callable(issue):
        raise UsbyteError("emulated link: expected a runtime channel (with an _issue), got "
                          f"{type(chan).__name__}")
    if getattr(issue, "emulated", False):
        raise UsbyteError("emulated link: already installed on this channel")
    link = EmulatedLink(chan.device) if link is None else link
    chan._issue = emulated_sum_issuer(issue, link, spec)
    return link


def comm_spec(spec: LinkSpec) -> Any:
    """The :class:`~usbyte_opt.formats.CommSpec` of ``spec`` (what the planner, the simulator
    and the lower bound cost collectives with): ``world_size`` its ranks, the all-reduce line
    ``alpha_ms + b / (algbw_gbs * 1e6)`` equal to :meth:`LinkSpec.allreduce_s`, and the
    reduce-scatter and all-gather lines of :meth:`LinkSpec.reduce_scatter_s` and
    :meth:`LinkSpec.all_gather_s`; backend ``analytic`` (a model, not a measurement), no
    samples, no training-thread cost.

    Example::

        >>> c = comm_spec(parse_emulate("8x1gbit@50us"))
        >>> c.world_size, c.alpha_ms, round(c.alpha_ms + 25e6 / (c.algbw_gbs * 1e6), 3)
        (8, 0.05, 350.05)
    """
    from ..formats import CollectiveCost, CommSpec

    n = spec.ranks
    alpha_ms = spec.alpha_s * 1e3
    half = CollectiveCost(alpha_ms, spec.bytes_per_s * n / (n - 1) / 1e9)
    return CommSpec("analytic", n, alpha_ms, spec.bytes_per_s * n / (2 * (n - 1)) / 1e9,
                    reduce_scatter=half, all_gather=half)


__all__ = ["CALIBRATION_CYCLES", "DEFAULT_ALPHA_S", "KINDS", "SPIN_S", "EmulatedHookState",
           "EmulatedLink", "EmulatedWork", "LinkSpec", "comm_spec", "cuda_cycles_per_s",
           "emulated_allreduce_hook",
           "emulated_sum_issuer", "install_on_channel", "parse_emulate"]
