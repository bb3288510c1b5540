"""The two file formats of usbyte-opt: profiles and schedules (docs/design.md §4).

Both are versioned JSON, validated on load (errors name the file, the field path and what was
expected) and written atomically (temporary file in the same folder, then ``os.replace``), so a
reader never sees half a file. This module imports no torch: the planner and the CLI's
``optimize`` stay fast.

Example::

    >>> p = Profile(name="toy", forward_ms=2.0, backward_ms=4.0,
    ...             tensors=(TensorSpec("w", (4, 4), "float32", ready_ms=1.0, need_ms=0.0),),
    ...             comm=CommSpec(backend="analytic", world_size=2, alpha_ms=0.1, algbw_gbs=1.0))
    >>> Profile.from_dict(p.to_dict(), "mem").tensors[0].nbytes
    64
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .errors import FormatError, MismatchError

PROFILE_FORMAT = "usbyte-profile"
SCHEDULE_FORMAT = "usbyte-schedule"
VERSION = 1

#: Bytes per element of the dtypes a gradient can have (names as ``str(torch.dtype)`` minus
#: the ``torch.`` prefix, so the runtime can compute the same fingerprint from a live model).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
}

COMM_BACKENDS = ("nccl", "gloo", "analytic", "mpi", "ucc")

#: How the runtime applies a schedule's updates: ``overlap`` (each tensor's update right
#: before its first use in the next forward, so communication overlaps that forward) or
#: ``fence`` (every block waited for, then every update, then the next forward, as DDP).
SCHEDULE_MODES = ("overlap", "fence")


# --------------------------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One trainable tensor of a profile (docs/design.md §2.1, §4.1)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ready_ms: float
    """Offset from the start of backward at which ``p.grad`` is final."""
    need_ms: float
    """Offset from the start of forward at which the tensor is first used."""
    update_ms: float = 0.0
    """Optimizer step cost for this tensor."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class CommSpec:
    """All-reduce cost of the process group: ``c(b) = alpha_ms + b / (algbw_gbs * 1e6)``."""

    backend: str
    world_size: int
    alpha_ms: float
    algbw_gbs: float
    samples: tuple[tuple[int, float], ...] = ()
    """Raw measurements ``(bytes, ms)``, optional."""
    cpu_ms_per_block: float = 0.0
    """Training-thread time one all-reduce costs while compute runs (its hook, the issue, the
    backend's polling on a shared core), optional: the planner's compute-cost option."""
    cpu_ms_per_mb: float = 0.0
    """Training-thread time per MB all-reduced while compute runs, optional (same option)."""


@dataclass(frozen=True, slots=True)
class Profile:
    """Per-tensor timing of one model on one cluster; the planner's only input."""

    name: str
    forward_ms: float
    backward_ms: float
    tensors: tuple[TensorSpec, ...]
    comm: CommSpec
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        comm: dict[str, Any] = {
            "backend": self.comm.backend,
            "world_size": self.comm.world_size,
            "alpha_ms": self.comm.alpha_ms,
            "algbw_gbs": self.comm.algbw_gbs,
        }
        if self.comm.samples:
            comm["samples"] = [{"bytes": b, "ms": ms} for b, ms in self.comm.samples]
        if self.comm.cpu_ms_per_block:
            comm["cpu_ms_per_block"] = self.comm.cpu_ms_per_block
        if self.comm.cpu_ms_per_mb:
            comm["cpu_ms_per_mb"] = self.comm.cpu_ms_per_mb
        tensors = []
        for t in self.tensors:
            d: dict[str, Any] = {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "ready_ms": t.ready_ms,
                "need_ms": t.need_ms,
            }
            if t.update_ms:
                d["update_ms"] = t.update_ms
            tensors.append(d)
        return {
            "format": PROFILE_FORMAT,
            "version": VERSION,
            "name": self.name,
            "meta": dict(self.meta),
            "forward_ms": self.forward_ms,
            "backward_ms": self.backward_ms,
            "tensors": tensors,
            "comm": comm,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<profile>") -> "Profile":
        return _parse_profile(data, source)

    def digest(self) -> str:
        """Content digest (16 hex digits) of the canonical JSON; schedules record it."""
        return _digest(self.to_dict())

    def fingerprint(self) -> str:
        """Digest of the sorted ``(name, shape, dtype)`` of the tensors (see :func:`fingerprint`)."""
        return fingerprint((t.name, t.shape, t.dtype) for t in self.tensors)

    def with_comm(self, comm: CommSpec) -> "Profile":
        return Profile(self.name, self.forward_ms, self.backward_ms, self.tensors, comm, self.meta)

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class Buffer:
    """One flat gradient buffer: its dtype and the tensors in layout order."""

    dtype: str
    tensors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Block:
    """A contiguous element range ``[start, end)`` of buffer ``buffer``: one all-reduce."""

    buffer: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Schedule:
    """A plan: buffer layout plus blocks in issue order (docs/design.md §4.2)."""

    strategy: str
    profile_name: str
    profile_digest: str
    fingerprint: str
    world_size: int
    buffers: tuple[Buffer, ...]
    blocks: tuple[Block, ...]
    predicted: Mapping[str, Any] = field(default_factory=dict)
    buffer_numel: tuple[int, ...] = ()
    """Total elements of each buffer (extra field, lets a schedule be checked on its own)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields this version does not know, kept so that a round trip loses nothing."""
    mode: str = "overlap"
    """How the runtime applies the updates: one of :data:`SCHEDULE_MODES`."""

    def to_dict(self) -> dict[str, Any]:
        buffers = []
        for i, b in enumerate(self.buffers):
            d: dict[str, Any] = {"dtype": b.dtype, "tensors": list(b.tensors)}
            if self.buffer_numel:
                d["numel"] = self.buffer_numel[i]
            buffers.append(d)
        out = {
            "format": SCHEDULE_FORMAT,
            "version": VERSION,
            "strategy": self.strategy,
            "profile": {"name": self.profile_name, "digest": self.profile_digest},
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "mode": self.mode,
            "buffers": buffers,
            "blocks": [{"buffer": k.buffer, "start": k.start, "end": k.end} for k in self.blocks],
            "predicted": dict(self.predicted),
        }
        for k, v in self.extra.items():
            out.setdefault(k, v)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "<schedule>") -> "Schedule":
        return _parse_schedule(data, source)

    def digest(self) -> str:
        """Digest of what every rank must agree on: layout and blocks (not predictions)."""
        d = self.to_dict()
        agreed = {"buffers": d["buffers"], "blocks": d["blocks"], "fp": self.fingerprint}
        if self.mode != "overlap":  # overlap schedules keep the digest they had before modes
            agreed["mode"] = self.mode
        return _digest(agreed)


# --------------------------------------------------------------------------------------------
# Digests
# --------------------------------------------------------------------------------------------


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(tensors: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """Digest of the sorted ``(name, shape, dtype)`` triples: what a schedule was made for.

    The runtime computes the same value from ``model.named_parameters()``.

    Example::

        >>> fingerprint([("b", (2,), "float32"), ("a", [3, 4], "float32")]) == \\
        ...     fingerprint([("a", (3, 4), "float32"), ("b", [2], "float32")])
        True
    """
    rows = sorted((str(n), [int(s) for s in shape], str(dt)) for n, shape, dt in tensors)
    return _digest(rows)


# --------------------------------------------------------------------------------------------
# Validation helpers: each failure names source, field path and expectation
# --------------------------------------------------------------------------------------------


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Reader:
    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, expected: str, got: Any = ...) -> FormatError:
        return FormatError(self.source, path, expected, got)

    def obj(self, d: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(d, Mapping):
            raise self.fail(path, "an object", _kind(d))
        return d

    def get(self, d: Mapping[str, Any], key: str, path: str, default: Any = ...) -> Any:
        if key not in d:
            if default is not ...:
                return default
            raise self.fail(_join(path, key), "a value (field is missing)")
        return d[key]

    def string(self, d, key, path, default=...) -> str:
        v = self.get(d, key, path, default)
        if not isinstance(v, str) or not v:
            raise self.fail(_join(path, key), "a non-empty string", v)
        return v

    def num(self, d, key, path, lo=None, hi=None, lo_open=False, default=...) -> float:
        v = self.get(d, key, path, default)
        ok = _is_num(v)
        if ok and lo is not None:
            ok = v > lo if lo_open else v >= lo
        if ok and hi is not None:
            ok = v <= hi
        if not ok:
            if lo is not None and hi is not None:
                want = f"a number in {'(' if lo_open else '['}{lo:.10g}, {hi:.10g}]"
            elif lo is not None:
                want = f"a number {'>' if lo_open else '>='} {lo:g}"
            else:
                want = "a finite number"
            raise self.fail(_join(path, key), want, v)
        return float(v)

    def integer(self, d, key, path, lo=None, default=...) -> int:
        v = self.get(d, key, path, default)
        if not _is_int(v) or (lo is not None and v < lo):
            raise self.fail(_join(path, key), "an integer" + (f" >= {lo}" if lo is not None else ""), v)
        return int(v)

    def array(self, d, key, path, default=...) -> list:
        v = self.get(d, key, path, default)
        if not isinstance(v, list):
            raise self.fail(_join(path, key), "an array", _kind(v))
        return v

    def header(self, d: Any, fmt: str) -> Mapping[str, Any]:
        d = self.obj(d, "")
        if d.get("format") != fmt:
            raise self.fail("format", f'"{fmt}"', d.get("format"))
        if d.get("version") != VERSION:
            raise self.fail("version", f"{VERSION} (the version this usbyte-opt reads)", d.get("version"))
        return d


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(v: Any) -> str:
    return type(v).__name__ if not isinstance(v, (str, int, float)) else v


def _parse_profile(data: Any, source: str) -> Profile:
    r = _Reader(source)
    d = r.header(data, PROFILE_FORMAT)
    name = r.string(d, "name", "")
    meta = r.obj(r.get(d, "meta", "", {}), "meta")
    F = r.num(d, "forward_ms", "", lo=0, lo_open=True)
    B = r.num(d, "backward_ms", "", lo=0, lo_open=True)
    raw = r.array(d, "tensors", "")
    if not raw:
        raise r.fail("tensors", "at least one trainable tensor", [])
    tensors = []
    seen: dict[str, int] = {}
    for i, t in enumerate(raw):
        p = f"tensors[{i}]"
        t = r.obj(t, p)
        tname = r.string(t, "name", p)
        if tname in seen:
            raise r.fail(f"{p}.name", f"a unique name (also tensors[{seen[tname]}])", tname)
        seen[tname] = i
        shape = r.array(t, "shape", p)
        if not all(_is_int(s) and s >= 1 for s in shape):
            raise r.fail(f"{p}.shape", "a list of integers >= 1", shape)
        dtype = r.string(t, "dtype", p)
        if dtype not in DTYPE_SIZES:
            raise r.fail(f"{p}.dtype", "one of " + "|".join(DTYPE_SIZES), dtype)
        ready = r.num(t, "ready_ms", p, lo=0, hi=B)
        need = r.num(t, "need_ms", p, lo=0, hi=F)
        upd = r.num(t, "update_ms", p, lo=0, default=0.0)
        tensors.append(TensorSpec(tname, tuple(shape), dtype, ready, need, upd))
    c = r.obj(r.get(d, "comm", ""), "comm")
    backend = r.string(c, "backend", "comm")
    if backend not in COMM_BACKENDS:
        raise r.fail("comm.backend", "one of " + "|".join(COMM_BACKENDS), backend)
    ws = r.integer(c, "world_size", "comm", lo=1)
    alpha = r.num(c, "alpha_ms", "comm", lo=0)
    algbw = r.num(c, "algbw_gbs", "comm", lo=0, lo_open=True)
    samples = []
    for i, s in enumerate(r.array(c, "samples", "comm", [])):
        p = f"comm.samples[{i}]"
        s = r.obj(s, p)
        samples.append((r.integer(s, "bytes", p, lo=1), r.num(s, "ms", p, lo=0, lo_open=True)))
    cpu_block = r.num(c, "cpu_ms_per_block", "comm", lo=0, default=0.0)
    cpu_mb = r.num(c, "cpu_ms_per_mb", "comm", lo=0, default=0.0)
    comm = CommSpec(backend, ws, alpha, algbw, tuple(samples), cpu_block, cpu_mb)
    return Profile(name, F, B, tuple(tensors), comm, dict(meta))


_SCHEDULE_KEYS = {"format", "version", "strategy", "profile", "fingerprint", "world_size",
                  "mode", "buffers", "blocks", "predicted"}


def _parse_schedule(data: Any, source: str) -> Schedule:
    r = _Reader(source)
    d = r.header(data, SCHEDULE_FORMAT)
    strategy = r.string(d, "strategy", "")
    prof = r.obj(r.get(d, "profile", ""), "profile")
    pname = r.string(prof, "name", "profile")
    pdigest = r.string(prof, "digest", "profile")
    fp = r.string(d, "fingerprint", "")
    ws = r.integer(d, "world_size", "", lo=1)
    mode = r.string(d, "mode", "", "overlap")
    if mode not in SCHEDULE_MODES:
        raise r.fail("mode", "one of " + "|".join(SCHEDULE_MODES), mode)
    buffers = []
    numels = []
    names: dict[str, str] = {}
    raw_buffers = r.array(d, "buffers", "")
    if not raw_buffers:
        raise r.fail("buffers", "at least one buffer", [])
    for i, b in enumerate(raw_buffers):
        p = f"buffers[{i}]"
        b = r.obj(b, p)
        dtype = r.string(b, "dtype", p)
        if dtype not in DTYPE_SIZES:
            raise r.fail(f"{p}.dtype", "one of " + "|".join(DTYPE_SIZES), dtype)
        ts = r.array(b, "tensors", p)
        if not ts:
            raise r.fail(f"{p}.tensors", "a non-empty list of tensor names", ts)
        for j, n in enumerate(ts):
            if not isinstance(n, str) or not n:
                raise r.fail(f"{p}.tensors[{j}]", "a tensor name", n)
            if n in names:
                raise r.fail(f"{p}.tensors[{j}]", f"a name listed once (also in {names[n]})", n)
            names[n] = p
        if "numel" in b:
            numels.append(r.integer(b, "numel", p, lo=1))
        buffers.append(Buffer(dtype, tuple(ts)))
    if numels and len(numels) != len(buffers):
        raise r.fail("buffers", "a numel on every buffer or on none")
    blocks = []
    for i, k in enumerate(r.array(d, "blocks", "")):
        p = f"blocks[{i}]"
        k = r.obj(k, p)
        bi = r.integer(k, "buffer", p, lo=0)
        if bi >= len(buffers):
            raise r.fail(f"{p}.buffer", f"a buffer index < {len(buffers)}", bi)
        s = r.integer(k, "start", p, lo=0)
        e = r.integer(k, "end", p, lo=0)
        if e <= s:
            raise r.fail(f"{p}.end", f"an offset > start ({s})", e)
        if numels and e > numels[bi]:
            raise r.fail(f"{p}.end", f"an offset <= the buffer's numel ({numels[bi]})", e)
        blocks.append(Block(bi, s, e))
    predicted = r.obj(r.get(d, "predicted", "", {}), "predicted")
    extra = {k: v for k, v in d.items() if k not in _SCHEDULE_KEYS}
    sched = Schedule(strategy, pname, pdigest, fp, ws, tuple(buffers), tuple(blocks),
                     dict(predicted), tuple(numels), extra, mode)
    if numels:
        check_coverage(sched, tuple(numels), source)
    return sched


def check_coverage(schedule: Schedule, buffer_numel: Sequence[int], source: str) -> None:
    """Raise :class:`FormatError` unless the blocks cover every buffer exactly once."""
    per: list[list[tuple[int, int, int]]] = [[] for _ in schedule.buffers]
    for i, k in enumerate(schedule.blocks):
        per[k.buffer].append((k.start, k.end, i))
    for b, spans in enumerate(per):
        spans.sort()
        pos = 0
        for s, e, i in spans:
            if s != pos:
                what = "overlaps the block before it" if s < pos else f"leaves [{pos}, {s}) uncovered"
                raise FormatError(source, f"blocks[{i}]", f"blocks covering buffer {b} exactly once; "
                                  f"this one starts at {s} and {what}")
            pos = e
        if pos != buffer_numel[b]:
            raise FormatError(source, f"buffers[{b}]", f"blocks covering all {buffer_numel[b]} "
                              f"elements; they cover [0, {pos})")


def check_against(schedule: Schedule, profile: Profile, source: str = "<schedule>") -> None:
    """Raise :class:`MismatchError` unless ``schedule`` was made for ``profile``'s tensors.

    Compares the fingerprints, then names the first differing tensor, then checks coverage
    of every buffer with the profile's sizes.
    """
    specs = {t.name: t for t in profile.tensors}
    listed = [n for b in schedule.buffers for n in b.tensors]
    for b_i, b in enumerate(schedule.buffers):
        for j, n in enumerate(b.tensors):
            if n not in specs:
                raise MismatchError(f"{source}: buffers[{b_i}].tensors[{j}]: tensor {n!r} is not "
                                    f"in profile {profile.name!r}")
            if specs[n].dtype != b.dtype:
                raise MismatchError(f"{source}: buffers[{b_i}].tensors[{j}]: tensor {n!r} has dtype "
                                    f"{specs[n].dtype} in the profile, buffer dtype is {b.dtype}")
    in_buffers = set(listed)
    missing = [n for n in specs if n not in in_buffers]
    if missing:
        raise MismatchError(f"{source}: buffers: profile tensor {missing[0]!r} is in no buffer "
                            f"({len(missing)} missing)")
    if schedule.fingerprint != profile.fingerprint():
        raise MismatchError(f"{source}: fingerprint: expected {profile.fingerprint()} (profile "
                            f"{profile.name!r}), got {schedule.fingerprint}: tensor shapes differ")
    numel = [sum(specs[n].numel for n in b.tensors) for b in schedule.buffers]
    if schedule.buffer_numel and tuple(numel) != tuple(schedule.buffer_numel):
        raise MismatchError(f"{source}: buffers: numel {list(schedule.buffer_numel)} does not match "
                            f"the profile's {numel}")
    check_coverage(schedule, numel, source)


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a missing, unreadable or malformed file is a :class:`FormatError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FormatError(str(path), "", "an existing file") from None
    except OSError as e:
        raise FormatError(str(path), "", f"a readable file ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(str(path), f"line {e.lineno} column {e.colno}", f"valid JSON ({e.msg})") from None


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write JSON atomically: a temporary file in the same folder, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a written file gets the usual mode
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def load_profile(path: str | os.PathLike) -> Profile:
    return _parse_profile(read_json(path), str(path))


def save_profile(profile: Profile, path: str | os.PathLike) -> Path:
    return write_json(path, profile.to_dict())


def load_schedule(path: str | os.PathLike) -> Schedule:
    return _parse_schedule(read_json(path), str(path))


def save_schedule(schedule: Schedule, path: str | os.PathLike) -> Path:
    return write_json(path, schedule.to_dict())


# --------------------------------------------------------------------------------------------
# JSON Schemas (printed by ``usbyte-opt schema``)
# --------------------------------------------------------------------------------------------

_NUM = {"type": "number"}


def profile_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the profile format."""
    tensor = {
        "type": "object",
        "required": ["name", "shape", "dtype", "ready_ms", "need_ms"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 1}},
            "dtype": {"enum": list(DTYPE_SIZES)},
            "ready_ms": {**_NUM, "minimum": 0, "description": "<= backward_ms"},
            "need_ms": {**_NUM, "minimum": 0, "description": "<= forward_ms"},
            "update_ms": {**_NUM, "minimum": 0, "default": 0},
        },
    }
    comm = {
        "type": "object",
        "required": ["backend", "world_size", "alpha_ms", "algbw_gbs"],
        "properties": {
            "backend": {"enum": list(COMM_BACKENDS)},
            "world_size": {"type": "integer", "minimum": 1},
            "alpha_ms": {**_NUM, "minimum": 0},
            "algbw_gbs": {**_NUM, "exclusiveMinimum": 0},
            "samples": {"type": "array", "items": {
                "type": "object", "required": ["bytes", "ms"],
                "properties": {"bytes": {"type": "integer", "minimum": 1},
                               "ms": {**_NUM, "exclusiveMinimum": 0}}}},
            "cpu_ms_per_block": {**_NUM, "minimum": 0, "default": 0,
                                 "description": "training-thread ms per all-reduce under compute"},
            "cpu_ms_per_mb": {**_NUM, "minimum": 0, "default": 0,
                              "description": "training-thread ms per MB all-reduced under compute"},
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "usbyte-opt profile",
        "type": "object",
        "required": ["format", "version", "name", "forward_ms", "backward_ms", "tensors", "comm"],
        "properties": {
            "format": {"const": PROFILE_FORMAT},
            "version": {"const": VERSION},
            "name": {"type": "string", "minLength": 1},
            "meta": {"type": "object"},
            "forward_ms": {**_NUM, "exclusiveMinimum": 0},
            "backward_ms": {**_NUM, "exclusiveMinimum": 0},
            "tensors": {"type": "array", "minItems": 1, "items": tensor},
            "comm": comm,
        },
    }


def schedule_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the schedule format."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "usbyte-opt schedule",
        "type": "object",
        "required": ["format", "version", "strategy", "profile", "fingerprint", "world_size",
                     "buffers", "blocks"],
        "properties": {
            "format": {"const": SCHEDULE_FORMAT},
            "version": {"const": VERSION},
            "strategy": {"type": "string"},
            "profile": {"type": "object", "required": ["name", "digest"],
                        "properties": {"name": {"type": "string"}, "digest": {"type": "string"}}},
            "fingerprint": {"type": "string"},
            "world_size": {"type": "integer", "minimum": 1},
            "mode": {"enum": list(SCHEDULE_MODES), "default": "overlap",
                     "description": "overlap: each update right before its first use in the "
                                    "next forward; fence: all blocks, then all updates (as DDP)"},
            "buffers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["dtype", "tensors"],
                "properties": {"dtype": {"enum": list(DTYPE_SIZES)},
                               "tensors": {"type": "array", "minItems": 1,
                                           "items": {"type": "string"}},
                               "numel": {"type": "integer", "minimum": 1}}}},
            "blocks": {"type": "array", "items": {
                "type": "object", "required": ["buffer", "start", "end"],
                "properties": {"buffer": {"type": "integer", "minimum": 0},
                               "start": {"type": "integer", "minimum": 0},
                               "end": {"type": "integer", "minimum": 1}}},
                "description": "issue order; together they cover every buffer exactly once"},
            "predicted": {"type": "object", "properties": {
                "iteration_ms": _NUM, "lower_bound_ms": _NUM, "compute_ms": _NUM,
                "baselines": {"type": "object", "additionalProperties": _NUM}}},
        },
    }
