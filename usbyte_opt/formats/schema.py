"""What a profile or schedule file may hold, defined once (docs/design.md §4).

The file shapes are the pydantic ``TypedDict`` models below: field types, required and
optional fields, defaults and physical bounds. Both the JSON Schema that ``usbyte-opt schema``
prints (:func:`profile_schema`, :func:`schedule_schema`) and the validation of every file read
(:func:`parse_profile`, :func:`parse_schedule`) come from them, so the two cannot disagree. A
file is validated once and converted into the frozen dataclasses of
:mod:`usbyte_opt.formats.data`, which the planner reads.

A failure is one :class:`~usbyte_opt.errors.FormatError` line: the file, the field path
(``tensors[3].ready_ms``), what was expected (read from the JSON Schema of that field) and what
was found. What one field cannot say alone is checked once every field is valid, with the same
kind of line: ``ready_ms`` within ``backward_ms``, unique names, the gradient bytes in all,
block offsets within their buffer, every buffer covered exactly once.

Example::

    >>> parse_profile({"format": "usbyte-profile", "version": 1, "name": "x", "forward_ms": 1,
    ...                "backward_ms": 2, "tensors": [], "comm": {}}, "x.json")
    Traceback (most recent call last):
    ...
    usbyte_opt.errors.FormatError: x.json: tensors: expected an array with at least one entry, got []
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from pydantic.json_schema import GenerateJsonSchema
from typing_extensions import NotRequired, TypedDict

from ..errors import FormatError
from .data import (
    COMM_BACKENDS,
    DTYPE_SIZES,
    PROFILE_FORMAT,
    SCHEDULE_FORMAT,
    SCHEDULE_MODES,
    VERSION,
    Block,
    Buffer,
    CommSpec,
    Profile,
    Schedule,
    TensorSpec,
    check_coverage,
)

# --------------------------------------------------------------------------------------------
# Physical bounds: generous for any real cluster, tight enough that planning stays finite and
# bounded in time and memory.
# --------------------------------------------------------------------------------------------

#: Longest time any field may give, ms: one hour (forward, backward, an update, a latency).
MAX_MS = 3_600_000.0
#: Most gradient bytes a profile may hold, every tensor together: 10 TB. A data-parallel rank
#: holds the whole gradient in its own memory, and no rank has memory near that.
MAX_GRADIENT_BYTES = 10**13
#: Most elements a tensor, a buffer or an offset may have: that many bytes of the smallest dtype.
MAX_ELEMENTS = MAX_GRADIENT_BYTES // min(DTYPE_SIZES.values())
#: All-reduce bandwidth (algbw), GB/s: from 1 kB/s to 100 TB/s.
MIN_ALGBW_GBS = 1e-6
MAX_ALGBW_GBS = 1e5
#: Most ranks a cost may be given for.
MAX_WORLD_SIZE = 10**7

# --------------------------------------------------------------------------------------------
# Field types
# --------------------------------------------------------------------------------------------

if TYPE_CHECKING:  # a type checker sees the plain types; pydantic, the allowed values
    Dtype: TypeAlias = str
    Backend: TypeAlias = str
    Mode: TypeAlias = str
    ProfileFormat: TypeAlias = str
    ScheduleFormat: TypeAlias = str
    Version: TypeAlias = int
else:
    Dtype = Literal[tuple(DTYPE_SIZES)]
    Backend = Literal[COMM_BACKENDS]
    Mode = Literal[SCHEDULE_MODES]
    ProfileFormat = Literal[PROFILE_FORMAT]
    ScheduleFormat = Literal[SCHEDULE_FORMAT]
    Version = Literal[VERSION]

Name = Annotated[str, Field(min_length=1)]
Ms = Annotated[float, Field(ge=0, le=MAX_MS)]
PositiveMs = Annotated[float, Field(gt=0, le=MAX_MS)]
Elements = Annotated[int, Field(ge=0, le=MAX_ELEMENTS)]
Shape = Annotated[list[Annotated[int, Field(ge=1, le=MAX_ELEMENTS)]],
                  Field(description=f"the tensor holds at most {MAX_GRADIENT_BYTES} bytes")]
NonNegative = Annotated[float, Field(ge=0)]


def _config(title: str, extra: Literal["ignore", "allow"] = "ignore") -> ConfigDict:
    """Every model: no coercion (``"1"`` is not a number, ``1.5`` not an integer, ``true``
    neither), no NaN or infinity; unknown fields ignored, or kept where ``extra="allow"``."""
    return ConfigDict(strict=True, allow_inf_nan=False, title=title, extra=extra)


_VERSION_NOTE = "the version this usbyte-opt reads"


@with_config(_config("tensor"))
class TensorEntry(TypedDict):
    """One trainable tensor of a profile."""

    name: Annotated[Name, Field(description="the name in model.named_parameters(); unique")]
    shape: Shape
    dtype: Annotated[Dtype, Field(description="the gradient's dtype; each dtype is one buffer")]
    ready_ms: Annotated[Ms, Field(description="offset from the start of backward at which the "
                                  "gradient is final; <= backward_ms")]
    need_ms: Annotated[Ms, Field(description="offset from the start of forward at which the "
                                 "tensor is first used; <= forward_ms")]
    update_ms: NotRequired[Annotated[Ms, Field(default=0.0, description="optimizer step cost")]]


@with_config(_config("sample"))
class SampleEntry(TypedDict):
    """One all-reduce measurement: bytes and milliseconds."""

    bytes: Annotated[int, Field(ge=1, le=MAX_GRADIENT_BYTES)]
    ms: PositiveMs


@with_config(_config("comm"))
class CommEntry(TypedDict):
    """All-reduce cost of the process group: alpha_ms + bytes / (algbw_gbs * 1e6)."""

    backend: Annotated[Backend, Field(description="where the cost comes from; analytic when it "
                                      "was computed, not measured")]
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE,
                                     description="ranks the cost holds for")]
    alpha_ms: Annotated[Ms, Field(description="latency of one all-reduce")]
    algbw_gbs: Annotated[float, Field(ge=MIN_ALGBW_GBS, le=MAX_ALGBW_GBS,
                                      description="algorithm bandwidth, GB/s")]
    samples: NotRequired[Annotated[list[SampleEntry], Field(
        default=[], description="the (bytes, ms) measurements the line was fitted to")]]
    cpu_ms_per_block: NotRequired[Annotated[Ms, Field(
        default=0.0, description="training-thread ms per all-reduce under compute")]]
    cpu_ms_per_mb: NotRequired[Annotated[Ms, Field(
        default=0.0, description="training-thread ms per MB all-reduced under compute")]]


@with_config(_config("usbyte-opt profile"))
class ProfileFile(TypedDict):
    """Per-tensor timing of one model on one cluster (docs/design.md §4.1)."""

    format: ProfileFormat
    version: Annotated[Version, Field(description=_VERSION_NOTE)]
    name: Annotated[Name, Field(description="the model's name")]
    meta: NotRequired[Annotated[dict[str, Any], Field(
        default={}, description="free-form: how and where it was measured")]]
    forward_ms: PositiveMs
    backward_ms: PositiveMs
    tensors: Annotated[list[TensorEntry], Field(
        min_length=1, description=f"one entry per trainable tensor; at most "
        f"{MAX_GRADIENT_BYTES} bytes of gradients in all")]
    comm: CommEntry


@with_config(_config("profile reference"))
class ProfileRef(TypedDict):
    """The profile a schedule was planned from."""

    name: Name
    digest: Name


@with_config(_config("buffer"))
class BufferEntry(TypedDict):
    """One flat gradient buffer: its dtype and its tensors in layout order."""

    dtype: Dtype
    tensors: Annotated[list[Name], Field(min_length=1, description="tensor names in layout "
                                         "order; each tensor in exactly one buffer")]
    numel: NotRequired[Annotated[int, Field(ge=1, le=MAX_ELEMENTS, description="elements in the "
                                            "buffer; on every buffer or on none")]]


@with_config(_config("block"))
class BlockEntry(TypedDict):
    """One all-reduce: the element range [start, end) of one buffer."""

    buffer: Annotated[int, Field(ge=0, description="index into buffers")]
    start: Elements
    end: Annotated[Elements, Field(description="> start; <= the buffer's numel")]


@with_config(_config("prediction", extra="allow"))
class PredictedEntry(TypedDict, total=False):
    """The planner's predictions, ms; other fields are kept."""

    iteration_ms: NonNegative
    mode: Mode
    lower_bound_ms: NonNegative
    gap: NonNegative
    compute_ms: NonNegative
    overlap_ms: NonNegative
    fence_ms: NonNegative
    baselines: dict[str, NonNegative]


@with_config(_config("usbyte-opt schedule", extra="allow"))
class ScheduleFile(TypedDict):
    """A plan: buffer layout and blocks in issue order (docs/design.md §4.2)."""

    format: ScheduleFormat
    version: Annotated[Version, Field(description=_VERSION_NOTE)]
    strategy: Annotated[Name, Field(description="the strategy that made it")]
    profile: ProfileRef
    fingerprint: Annotated[Name, Field(description="the profile's fingerprint")]
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
    mode: NotRequired[Annotated[Mode, Field(
        default="overlap", description="overlap: each update right before its first use in the "
        "next forward; fence: all blocks, then all updates (as DDP)")]]
    buffers: Annotated[list[BufferEntry], Field(min_length=1)]
    blocks: Annotated[list[BlockEntry], Field(description="issue order; together they cover "
                                              "every buffer exactly once")]
    predicted: NotRequired[Annotated[PredictedEntry, Field(default={})]]
    shapes: NotRequired[Annotated[dict[str, Shape], Field(description="every tensor's shape")]]
    comm: NotRequired[Annotated[dict[str, Any], Field(description="the cost model planned for")]]
    info: NotRequired[Annotated[dict[str, Any], Field(description="the strategy's knobs")]]


# --------------------------------------------------------------------------------------------
# JSON Schemas
# --------------------------------------------------------------------------------------------


class _Generator(GenerateJsonSchema):
    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@functools.cache
def _adapter(kind: str) -> TypeAdapter[Any]:
    return TypeAdapter(ProfileFile if kind == "profile" else ScheduleFile)


@functools.cache
def _schema(kind: str) -> dict[str, Any]:
    body = _adapter(kind).json_schema(schema_generator=_Generator)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **body}


def profile_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the profile format.

    Example::

        >>> profile_schema()["properties"]["forward_ms"]
        {'exclusiveMinimum': 0, 'maximum': 3600000.0, 'type': 'number'}
    """
    return copy.deepcopy(_schema("profile"))


def schedule_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the schedule format."""
    return copy.deepcopy(_schema("schedule"))


# --------------------------------------------------------------------------------------------
# Validation errors as one line
# --------------------------------------------------------------------------------------------

#: Tensor fields whose upper bound is a profile field: their expectation names its value.
_CAPPED_BY = {"ready_ms": "backward_ms", "need_ms": "forward_ms"}


def _g(x: float) -> str:
    return f"{x:.10g}"


def number_range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    """What a number field expects, in words.

    Example::

        >>> number_range(0, 6), number_range(0, 60, lo_open=True), number_range(1e-6, 1e5)
        ('a number in [0, 6]', 'a number > 0 and <= 60', 'a number > 0, from 1e-06 to 100000')
    """
    if lo is None and hi is None:
        return "a finite number"
    if hi is None:
        return f"a number {'>' if lo_open else '>='} {_g(lo)}"  # type: ignore[arg-type]
    if lo is None:
        return f"a number <= {_g(hi)}"
    if lo_open:
        return f"a number > {_g(lo)} and <= {_g(hi)}"
    if lo > 0:
        return f"a number > 0, from {_g(lo)} to {_g(hi)}"
    return f"a number in [{_g(lo)}, {_g(hi)}]"


def _integer_range(noun: str, sub: dict[str, Any]) -> str:
    text = noun
    if "minimum" in sub:
        text += f" >= {_g(sub['minimum'])}"
    if "maximum" in sub:
        text += (" and" if "minimum" in sub else "") + f" <= {_g(sub['maximum'])}"
    return text


def _bound(data: Any, name: str) -> float | None:
    """``data[name]`` when it is a number within its own bounds (a cap for another field)."""
    v = data.get(name) if isinstance(data, dict) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_MS:
        return float(v)
    return None


def _describe(sub: dict[str, Any], keys: Sequence[Any], data: Any) -> str:
    """The expectation of the field at ``keys``, from its JSON Schema ``sub``."""
    if "const" in sub:
        text = json.dumps(sub["const"])
        return text + (f" ({sub['description']})" if "description" in sub else "")
    if "enum" in sub:
        return "one of " + "|".join(str(v) for v in sub["enum"])
    kind = sub.get("type")
    if kind == "string":
        return "a non-empty string" if sub.get("minLength") else "a string"
    if kind == "integer":
        return _integer_range("an integer", sub)
    if kind == "number":
        lo_open = "exclusiveMinimum" in sub
        lo = sub.get("exclusiveMinimum", sub.get("minimum"))
        hi = sub.get("maximum")
        if keys and keys[0] == "tensors" and keys[-1] in _CAPPED_BY:
            cap = _bound(data, _CAPPED_BY[keys[-1]])
            if cap is not None:
                hi = cap if hi is None else min(hi, cap)
        return number_range(lo, hi, lo_open)
    if kind == "array":
        items = sub.get("items", {})
        if items.get("type") == "integer":
            return "a list of " + _integer_range("integers", items)
        return "an array with at least one entry" if sub.get("minItems") else "an array"
    if kind == "object":
        return "an object"
    return "a valid value"


def _deref(root: dict[str, Any], sub: Any) -> dict[str, Any]:
    while isinstance(sub, dict) and "$ref" in sub:
        sub = root["$defs"][sub["$ref"].rsplit("/", 1)[-1]]
    return sub if isinstance(sub, dict) else {}


def _child(root: dict[str, Any], sub: dict[str, Any], key: Any) -> dict[str, Any]:
    if isinstance(key, int):
        return _deref(root, sub.get("items"))
    props = sub.get("properties", {})
    return _deref(root, props[key] if key in props else sub.get("additionalProperties"))


def _path(keys: Sequence[Any]) -> str:
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _at(data: Any, keys: Sequence[Any]) -> Any:
    for k in keys:
        data = data[k]
    return data


def _shown(got: Any, sub: dict[str, Any]) -> Any:
    """The value as an error shows it: scalars and arrays where arrays belong as they are,
    anything else by its type name."""
    if got is None or isinstance(got, (str, int, float, bool)):
        return got
    if isinstance(got, list) and sub.get("type") == "array":
        return got
    return type(got).__name__


def _error(err: Any, data: Any, root: dict[str, Any], source: str) -> FormatError:
    """The first pydantic error as one :class:`FormatError`. An error inside an array of
    integers (a shape) is reported on the array: it is one value."""
    loc = list(err["loc"])
    sub = _deref(root, root)
    keys: list[Any] = []
    for key in loc:
        if sub.get("type") == "array" and sub.get("items", {}).get("type") == "integer":
            break
        keys.append(key)
        sub = _child(root, sub, key)
    if len(keys) == len(loc):
        if err["type"] == "missing":
            return FormatError(source, _path(keys), "a value (field is missing)")
        if err["type"] == "string_unicode":
            return FormatError(source, _path(keys), "a string of valid Unicode (no lone "
                               "surrogate)", err["input"])
    return FormatError(source, _path(keys), _describe(sub, keys, data),
                       _shown(_at(data, keys), sub))


def _validate(kind: str, data: Any, source: str) -> dict[str, Any]:
    try:
        return _adapter(kind).validate_python(data)
    except ValidationError as e:
        raise _error(e.errors(include_url=False, include_context=False)[0], data,
                     _schema(kind), source) from None


# --------------------------------------------------------------------------------------------
# Files to objects, with the checks across fields
# --------------------------------------------------------------------------------------------


def parse_profile(data: Any, source: str = "<profile>") -> Profile:
    """Validate a profile file's JSON value and build the :class:`Profile`."""
    d = _validate("profile", data, source)
    F, B = d["forward_ms"], d["backward_ms"]
    tensors = []
    seen: dict[str, int] = {}
    total = 0
    for i, t in enumerate(d["tensors"]):
        p = f"tensors[{i}]"
        name, shape, dtype = t["name"], t["shape"], t["dtype"]
        if name in seen:
            raise FormatError(source, f"{p}.name", f"a unique name (also tensors[{seen[name]}])", name)
        seen[name] = i
        if t["ready_ms"] > B:
            raise FormatError(source, f"{p}.ready_ms", number_range(0, B), t["ready_ms"])
        if t["need_ms"] > F:
            raise FormatError(source, f"{p}.need_ms", number_range(0, F), t["need_ms"])
        size = DTYPE_SIZES[dtype]
        numel = 1
        for s in shape:
            numel *= s
            if numel > MAX_ELEMENTS:
                break
        if numel * size > MAX_GRADIENT_BYTES:
            raise FormatError(source, f"{p}.shape", f"a shape of at most "
                              f"{_g(MAX_GRADIENT_BYTES // size)} elements ({_g(MAX_GRADIENT_BYTES)} "
                              f"bytes of {dtype})", shape)
        total += numel * size
        if total > MAX_GRADIENT_BYTES:
            raise FormatError(source, "tensors", f"at most {_g(MAX_GRADIENT_BYTES)} bytes of "
                              f"gradients in all (tensors[0] to tensors[{i}] hold more)", total)
        tensors.append(TensorSpec(name, tuple(shape), dtype, t["ready_ms"], t["need_ms"],
                                  t["update_ms"]))
    c = d["comm"]
    comm = CommSpec(c["backend"], c["world_size"], c["alpha_ms"], c["algbw_gbs"],
                    tuple((s["bytes"], s["ms"]) for s in c["samples"]), c["cpu_ms_per_block"],
                    c["cpu_ms_per_mb"])
    return Profile(d["name"], F, B, tuple(tensors), comm, dict(d["meta"]))


#: Schedule fields that become :class:`Schedule` attributes; any other is kept in ``extra``.
_SCHEDULE_KEYS = {"format", "version", "strategy", "profile", "fingerprint", "world_size",
                  "mode", "buffers", "blocks", "predicted"}


def parse_schedule(data: Any, source: str = "<schedule>") -> Schedule:
    """Validate a schedule file's JSON value and build the :class:`Schedule`."""
    d = _validate("schedule", data, source)
    buffers = []
    numels = []
    names: dict[str, str] = {}
    for i, b in enumerate(d["buffers"]):
        p = f"buffers[{i}]"
        for j, n in enumerate(b["tensors"]):
            if n in names:
                raise FormatError(source, f"{p}.tensors[{j}]",
                                  f"a name listed once (also in {names[n]})", n)
            names[n] = p
        if "numel" in b:
            numels.append(b["numel"])
        buffers.append(Buffer(b["dtype"], tuple(b["tensors"])))
    if numels and len(numels) != len(buffers):
        raise FormatError(source, "buffers", "a numel on every buffer or on none")
    blocks = []
    for i, k in enumerate(d["blocks"]):
        p = f"blocks[{i}]"
        bi, s, e = k["buffer"], k["start"], k["end"]
        if bi >= len(buffers):
            raise FormatError(source, f"{p}.buffer", f"a buffer index < {len(buffers)}", bi)
        if e <= s:
            raise FormatError(source, f"{p}.end", f"an offset > start ({s})", e)
        if numels and e > numels[bi]:
            raise FormatError(source, f"{p}.end", f"an offset <= the buffer's numel ({numels[bi]})", e)
        blocks.append(Block(bi, s, e))
    extra = {k: v for k, v in d.items() if k not in _SCHEDULE_KEYS}
    sched = Schedule(d["strategy"], d["profile"]["name"], d["profile"]["digest"], d["fingerprint"],
                     d["world_size"], tuple(buffers), tuple(blocks), dict(d["predicted"]), tuple(numels),
                     extra, d["mode"])
    if numels:
        check_coverage(sched, tuple(numels), source)
    return sched


__all__ = ["MAX_ALGBW_GBS", "MAX_ELEMENTS", "MAX_GRADIENT_BYTES", "MAX_MS", "MAX_WORLD_SIZE",
           "MIN_ALGBW_GBS", "number_range", "parse_profile", "parse_schedule", "profile_schema",
           "schedule_schema"]
