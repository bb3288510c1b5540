"""Profile and schedule files and the objects of :mod:`usbyte_opt.formats.data`, both ways
(docs/design.md §4): the one definition of what a file may hold and of how it maps to the
frozen dataclasses.

What a file may hold is the ``TypedDict`` records below: field types, required and optional
fields, defaults, physical bounds and descriptions, the bounds as :class:`Rule` data. From them
come the JSON Schema that ``usbyte-opt schema`` prints (:func:`profile_schema`,
:func:`schedule_schema`), the validation of every file read (:func:`parse_profile`,
:func:`parse_schedule`, with pydantic) and the check of every object written
(:func:`dump_profile`, :func:`dump_schedule` given a ``source``, in plain Python), so that the
three cannot disagree. pydantic is imported only to read a file or print a schema: building,
dumping and saving objects need none.

A failure is one :class:`~usbyte_opt.errors.FormatError` line: the file, the field path
(``tensors[3].ready_ms``), what was expected (from the record's definition of that field) and
what was found. What one field cannot say alone is checked once every field is valid, with the
same kind of line: ``ready_ms`` within ``backward_ms``, unique names, the gradient bytes in all,
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
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, get_args, get_origin

from typing_extensions import NotRequired, TypedDict, get_type_hints, is_typeddict

from ..errors import FormatError
from .data import (
    COMM_BACKENDS,
    DTYPE_SIZES,
    PROFILE_FORMAT,
    SCHEDULE_FORMAT,
    SCHEDULE_MODES,
    SCHEDULE_RUNNERS,
    VERSION,
    Block,
    Buffer,
    CollectiveCost,
    CommSpec,
    HostCost,
    Mode,
    Profile,
    Runner,
    Schedule,
    TensorSpec,
    check_coverage,
    check_runner,
    profile_json,
    schedule_json,
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
#: Longest host time per tensor or per block, µs: one second.
MAX_HOST_US = 1e6

# --------------------------------------------------------------------------------------------
# Field types
# --------------------------------------------------------------------------------------------


class Rule:
    """What a field allows beyond its type, and what the JSON Schema says of it: the keyword
    arguments of pydantic's ``Field`` (``ge``, ``gt``, ``le``, ``min_length``, ``default``,
    ``description``), kept as plain data until a file is read or a schema printed.

    Example::

        >>> Rule(ge=0, le=6)
        Rule(ge=0, le=6)
    """

    __slots__ = ("kw",)

    def __init__(self, **kw: Any) -> None:
        self.kw = kw

    def __repr__(self) -> str:
        return f"Rule({', '.join(f'{k}={v!r}' for k, v in self.kw.items())})"


if TYPE_CHECKING:  # a type checker sees the plain types; the records, the allowed values
    Dtype: TypeAlias = str
    Backend: TypeAlias = str
    ModeName: TypeAlias = str
    RunnerName: TypeAlias = str
    ProfileFormat: TypeAlias = str
    ScheduleFormat: TypeAlias = str
    Version: TypeAlias = int
else:
    Dtype = Literal[tuple(DTYPE_SIZES)]
    Backend = Literal[COMM_BACKENDS]
    ModeName = Literal[SCHEDULE_MODES]
    RunnerName = Literal[SCHEDULE_RUNNERS]
    ProfileFormat = Literal[PROFILE_FORMAT]
    ScheduleFormat = Literal[SCHEDULE_FORMAT]
    Version = Literal[VERSION]

Name = Annotated[str, Rule(min_length=1)]
Ms = Annotated[float, Rule(ge=0, le=MAX_MS)]
PositiveMs = Annotated[float, Rule(gt=0, le=MAX_MS)]
Elements = Annotated[int, Rule(ge=0, le=MAX_ELEMENTS)]
Shape = Annotated[list[Annotated[int, Rule(ge=1, le=MAX_ELEMENTS)]],
                  Rule(description=f"the tensor holds at most {MAX_GRADIENT_BYTES} bytes")]
NonNegative = Annotated[float, Rule(ge=0)]

#: Each record's title and what it does with fields it does not define: ``"ignore"`` drops
#: them, ``"allow"`` keeps them.
_RECORDS: dict[type, tuple[str, Literal["ignore", "allow"]]] = {}


def _record(title: str, extra: Literal["ignore", "allow"] = "ignore") -> Any:
    def register(cls: type) -> type:
        _RECORDS[cls] = (title, extra)
        return cls
    return register


_VERSION_NOTE = "the version this usbyte-opt reads"


@_record("tensor")
class TensorEntry(TypedDict):
    """One trainable tensor of a profile."""

    name: Annotated[Name, Rule(description="the name in model.named_parameters(); unique")]
    shape: Shape
    dtype: Annotated[Dtype, Rule(description="the gradient's dtype; each dtype is one buffer")]
    ready_ms: Annotated[Ms, Rule(description="offset from the start of backward at which the "
                                 "gradient is final; <= backward_ms")]
    need_ms: Annotated[Ms, Rule(description="offset from the start of forward at which the "
                                "tensor is first used; <= forward_ms")]
    update_ms: NotRequired[Annotated[Ms, Rule(default=0.0, description="optimizer step cost")]]


@_record("sample")
class SampleEntry(TypedDict):
    """One all-reduce measurement: bytes and milliseconds."""

    bytes: Annotated[int, Rule(ge=1, le=MAX_GRADIENT_BYTES)]
    ms: PositiveMs


@_record("collective cost")
class CollectiveEntry(TypedDict):
    """Cost of one collective other than all-reduce: alpha_ms + bytes / (algbw_gbs * 1e6), bytes
    the whole (unsharded) block's."""

    alpha_ms: Annotated[Ms, Rule(description="latency of one call")]
    algbw_gbs: Annotated[float, Rule(ge=MIN_ALGBW_GBS, le=MAX_ALGBW_GBS,
                                     description="whole block's bytes over time, GB/s")]
    samples: NotRequired[Annotated[list[SampleEntry], Rule(
        default=[], description="the (bytes, ms) measurements the line was fitted to")]]


@_record("comm")
class CommEntry(TypedDict):
    """All-reduce cost of the process group: alpha_ms + bytes / (algbw_gbs * 1e6)."""

    backend: Annotated[Backend, Rule(description="where the cost comes from; analytic when it "
                                     "was computed, not measured")]
    world_size: Annotated[int, Rule(ge=1, le=MAX_WORLD_SIZE,
                                    description="ranks the cost holds for")]
    alpha_ms: Annotated[Ms, Rule(description="latency of one all-reduce")]
    algbw_gbs: Annotated[float, Rule(ge=MIN_ALGBW_GBS, le=MAX_ALGBW_GBS,
                                     description="algorithm bandwidth, GB/s")]
    samples: NotRequired[Annotated[list[SampleEntry], Rule(
        default=[], description="the (bytes, ms) measurements the line was fitted to")]]
    cpu_ms_per_block: NotRequired[Annotated[Ms, Rule(
        default=0.0, description="training-thread ms per all-reduce under compute")]]
    cpu_ms_per_mb: NotRequired[Annotated[Ms, Rule(
        default=0.0, description="training-thread ms per MB all-reduced under compute")]]
    reduce_scatter: NotRequired[Annotated[CollectiveEntry, Rule(
        description="measured reduce-scatter cost (bytes in; bytes / world_size out per rank); "
                    "absent: half an all-reduce")]]
    all_gather: NotRequired[Annotated[CollectiveEntry, Rule(
        description="measured all-gather cost (bytes out; bytes / world_size in per rank); "
                    "absent: half an all-reduce")]]
    nodes: NotRequired[Annotated[int, Rule(
        ge=1, le=MAX_WORLD_SIZE, default=1,
        description="nodes the ranks are on, world_size / nodes on each (torchrun's "
                    "--nnodes); divides world_size")]]
    intra: NotRequired[Annotated[CollectiveEntry, Rule(
        description="all-reduce cost on the ranks of one node (bytes the whole block's); "
                    "measured with several nodes of several ranks")]]
    inter: NotRequired[Annotated[CollectiveEntry, Rule(
        description="all-reduce cost on one rank per node, the others idle (bytes the whole "
                    "block's); measured with intra")]]


HostUs = Annotated[float, Rule(ge=0, le=MAX_HOST_US)]


@_record("host cost")
class HostEntry(TypedDict):
    """What the host pays per iteration to run a plan, beyond the plain training loop, µs."""

    runtime_tensor_us: Annotated[HostUs, Rule(description="the usbyte-opt runtime, per "
                                              "trainable tensor (hook and bookkeeping)")]
    runtime_block_us: Annotated[HostUs, Rule(description="the runtime, per block (issuing "
                                             "one asynchronous all-reduce, its wait)")]
    ddp_tensor_us: Annotated[HostUs, Rule(description="torch DDP, per trainable tensor")]
    ddp_bucket_us: Annotated[HostUs, Rule(description="torch DDP, per bucket")]
    launch_bound: Annotated[bool, Rule(description="whether the host's time is on the "
                                       "critical path: on CUDA, host time per iteration >= "
                                       "GPU time; true on CPU")]
    method: NotRequired[Annotated[str, Rule(default="", description="how it was measured")]]


@_record("usbyte-opt profile")
class ProfileFile(TypedDict):
    """Per-tensor timing of one model on one cluster (docs/design.md §4.1)."""

    format: ProfileFormat
    version: Annotated[Version, Rule(description=_VERSION_NOTE)]
    name: Annotated[Name, Rule(description="the model's name")]
    meta: NotRequired[Annotated[dict[str, Any], Rule(
        default={}, description="free-form: how and where it was measured")]]
    forward_ms: PositiveMs
    backward_ms: PositiveMs
    tensors: Annotated[list[TensorEntry], Rule(
        min_length=1, description=f"one entry per trainable tensor; at most "
        f"{MAX_GRADIENT_BYTES} bytes of gradients in all")]
    comm: CommEntry
    host: NotRequired[Annotated[HostEntry, Rule(
        description="the host's cost per tensor and per block of the runtime and of DDP; "
                    "absent: the documented defaults (docs/profiles.md)")]]


@_record("profile reference")
class ProfileRef(TypedDict):
    """The profile a schedule was planned from."""

    name: Name
    digest: Name


@_record("buffer")
class BufferEntry(TypedDict):
    """One flat gradient buffer: its dtype and its tensors in layout order."""

    dtype: Dtype
    tensors: Annotated[list[Name], Rule(min_length=1, description="tensor names in layout "
                                        "order; each tensor in exactly one buffer")]
    numel: NotRequired[Annotated[int, Rule(ge=1, le=MAX_ELEMENTS, description="elements in the "
                                           "buffer; on every buffer or on none")]]


@_record("block")
class BlockEntry(TypedDict):
    """One all-reduce: the element range [start, end) of one buffer."""

    buffer: Annotated[int, Rule(ge=0, description="index into buffers")]
    start: Elements
    end: Annotated[Elements, Rule(description="> start; <= the buffer's numel")]
    hier: NotRequired[Annotated[bool, Rule(
        default=False, description="all-reduced hierarchically: reduce-scatter inside each "
                                   "node, all-reduce across nodes, all-gather inside (needs "
                                   "nodes > 1 with several ranks each, not sharded mode)")]]


@_record("prediction", extra="allow")
class PredictedEntry(TypedDict, total=False):
    """The planner's predictions, ms; other fields are kept."""

    iteration_ms: NonNegative
    mode: ModeName
    lower_bound_ms: NonNegative
    gap: NonNegative
    compute_ms: NonNegative
    overlap_ms: NonNegative
    fence_ms: NonNegative
    baselines: dict[str, NonNegative]


#: What the schema says of ``mode``: each mode's file value and what it does (one per :class:`Mode`).
_MODE_NOTE = "; ".join(f"{m}: {m.note}" for m in Mode)
#: What the schema says of ``runner`` (one per :class:`Runner`).
_RUNNER_NOTE = "what runs the schedule; " + "; ".join(f"{r}: {r.note}" for r in Runner)


@_record("usbyte-opt schedule", extra="allow")
class ScheduleFile(TypedDict):
    """A plan: buffer layout and blocks in issue order (docs/design.md §4.2)."""

    format: ScheduleFormat
    version: Annotated[Version, Rule(description=_VERSION_NOTE)]
    strategy: Annotated[Name, Rule(description="the strategy that made it")]
    profile: ProfileRef
    model: NotRequired[Annotated[Name, Rule(description="the model it was planned for (the "
                                            "profile's meta.model, else its name); named when "
                                            "another model is given the schedule")]]
    fingerprint: Annotated[Name, Rule(description="the profile's fingerprint")]
    world_size: Annotated[int, Rule(ge=1, le=MAX_WORLD_SIZE)]
    nodes: NotRequired[Annotated[int, Rule(
        ge=1, le=MAX_WORLD_SIZE, default=1,
        description="nodes of world_size / nodes ranks each, as hierarchical blocks group "
                    "them; divides world_size")]]
    mode: NotRequired[Annotated[ModeName, Rule(default=str(Mode.OVERLAP), description=_MODE_NOTE)]]
    runner: NotRequired[Annotated[RunnerName, Rule(default=str(Runner.RUNTIME),
                                                   description=_RUNNER_NOTE)]]
    bucket_cap_mb_list: NotRequired[Annotated[list[Annotated[float, Rule(gt=0)]], Rule(
        description="runner ddp: torch DDP's bucket_cap_mb_list, MiB, one cap per block in "
                    "block order, each closing its bucket right after the block's last tensor")]]
    buffers: Annotated[list[BufferEntry], Rule(min_length=1)]
    blocks: Annotated[list[BlockEntry], Rule(description="issue order; together they cover "
                                             "every buffer exactly once")]
    predicted: NotRequired[Annotated[PredictedEntry, Rule(default={})]]
    shapes: NotRequired[Annotated[dict[str, Shape], Rule(description="every tensor's shape")]]
    gathers: NotRequired[Annotated[list[Annotated[list[Annotated[int, Rule(ge=0)]],
                                                  Rule(min_length=1)]],
                                   Rule(description="sharded mode: the parameter all-gathers in "
                                        "issue order, each a list of block indices gathered "
                                        "together; every block in exactly one (default: one "
                                        "per block, in reverse block order)")]]
    cut_pieces: NotRequired[Annotated[list[Annotated[int, Rule(ge=1)]], Rule(
        description="compiled training: the plan's pieces (tensors grouped by the first and last "
                    "block holding them, numbered in issue order) before which a compiled graph "
                    "is cut, ascending; the others join the piece before them (default: every "
                    "piece)")]]
    comm: NotRequired[Annotated[dict[str, Any], Rule(description="the cost model planned for")]]
    info: NotRequired[Annotated[dict[str, Any], Rule(description="the strategy's knobs")]]


_FILES: dict[str, type] = {"profile": ProfileFile, "schedule": ScheduleFile}

# --------------------------------------------------------------------------------------------
# Reading the records: a type's parts, its JSON Schema fragment
# --------------------------------------------------------------------------------------------


def _split(tp: Any) -> tuple[Any, dict[str, Any]]:
    """``tp`` without ``NotRequired`` and ``Annotated``, and its rules merged."""
    kw: dict[str, Any] = {}
    while True:
        origin = get_origin(tp)
        if origin is NotRequired:
            tp = get_args(tp)[0]
        elif origin is Annotated:
            for m in tp.__metadata__:
                if isinstance(m, Rule):
                    kw.update(m.kw)
            tp = tp.__origin__
        else:
            return tp, kw


@functools.cache
def _fields(record: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A record's field types, in order, and its required fields (from the types: the
    annotations are strings until resolved, so ``__required_keys__`` cannot tell)."""
    hints = get_type_hints(record, include_extras=True)
    total = record.__total__  # type: ignore[attr-defined]
    return hints, frozenset(k for k, t in hints.items() if total and get_origin(t) is not NotRequired)


def _is_int_list(tp: Any) -> bool:
    base, _ = _split(tp)
    return get_origin(base) is list and _split(get_args(base)[0])[0] is int


def _child(tp: Any, key: Any) -> Any:
    """The type of ``key`` within a value of type ``tp`` (``Any`` where nothing defines it)."""
    base, _ = _split(tp)
    if is_typeddict(base):
        return _fields(base)[0].get(key, Any)
    origin = get_origin(base)
    if origin is list:
        return get_args(base)[0]
    if origin is dict:
        return get_args(base)[1]
    return Any


def _fragment(tp: Any) -> dict[str, Any]:
    """What the JSON Schema says of a value of type ``tp``, in the keywords errors read."""
    base, kw = _split(tp)
    out: dict[str, Any] = {}
    origin = get_origin(base)
    if is_typeddict(base) or origin is dict:
        out["type"] = "object"
    elif origin is list:
        out.update(type="array", items=_fragment(get_args(base)[0]))
        if kw.get("min_length"):
            out["minItems"] = kw["min_length"]
    elif origin is Literal:
        values = get_args(base)
        out.update({"const": values[0]} if len(values) == 1 else {"enum": list(values)})
    elif base is bool:
        out["type"] = "boolean"
    elif base is str:
        out["type"] = "string"
        if kw.get("min_length"):
            out["minLength"] = kw["min_length"]
    elif base in (int, float):
        out["type"] = "integer" if base is int else "number"
        for rule, word in (("ge", "minimum"), ("gt", "exclusiveMinimum"), ("le", "maximum")):
            if rule in kw:
                out[word] = kw[rule]
    if "description" in kw:
        out["description"] = kw["description"]
    return out


# --------------------------------------------------------------------------------------------
# JSON Schemas and validation with pydantic (imported here only)
# --------------------------------------------------------------------------------------------


@functools.cache
def _pydantic_type(tp: Any) -> Any:
    """``tp`` as pydantic reads it: each :class:`Rule` a ``Field``, each record a ``TypedDict``
    of the same name with its config."""
    from pydantic import ConfigDict, Field, with_config

    # Types built at run time: a type checker sees values, not types.
    annotated: Any = Annotated
    generic: Any = {list: list, dict: dict, NotRequired: NotRequired}
    record: Any = TypedDict
    origin = get_origin(tp)
    if origin is Annotated:
        meta = tuple(Field(**m.kw) if isinstance(m, Rule) else m for m in tp.__metadata__)
        return annotated[(_pydantic_type(tp.__origin__),) + meta]
    if origin in generic:
        args = tuple(_pydantic_type(a) for a in get_args(tp))
        return generic[origin][args if len(args) > 1 else args[0]]
    if is_typeddict(tp):
        hints, _ = _fields(tp)
        out = record(tp.__name__, {k: _pydantic_type(v) for k, v in hints.items()},
                     total=tp.__total__)
        out.__doc__, out.__module__, out.__qualname__ = tp.__doc__, tp.__module__, tp.__qualname__
        title, extra = _RECORDS[tp]
        # No coercion ("1" is not a number, 1.5 not an integer, true neither), no NaN or
        # infinity; unknown fields ignored, or kept where extra="allow".
        return with_config(ConfigDict(strict=True, allow_inf_nan=False, title=title,
                                      extra=extra))(out)
    return tp


@functools.cache
def _adapter(kind: str) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(_pydantic_type(_FILES[kind]))


@functools.cache
def _schema(kind: str) -> dict[str, Any]:
    from pydantic.json_schema import GenerateJsonSchema

    class Generator(GenerateJsonSchema):
        def field_title_should_be_set(self, schema: Any) -> bool:
            return False

    body = _adapter(kind).json_schema(schema_generator=Generator)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **body}


def profile_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the profile format.

    Example::

        >>> profile_schema()["properties"]["forward_ms"]
        {'exclusiveMinimum': 0, 'maximum': 3600000.0, 'type': 'number'}
    """
    return copy.deepcopy(_schema("profile"))


def schedule_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the schedule format.

    Example::

        >>> schedule_schema()["properties"]["mode"]["enum"]
        ['overlap', 'fence', 'sharded']
    """
    return copy.deepcopy(_schema("schedule"))


def _validate(kind: str, data: Any, source: str) -> dict[str, Any]:
    """``data`` validated by pydantic, defaults filled in; its first error as one line."""
    from pydantic import ValidationError

    if isinstance(data, dict) and isinstance(data.get("version"), bool):
        # (a JSON true equals 1 to Python's Literal check; JSON Schema's const does not)
        raise FormatError(source, "version", f"{VERSION} ({_VERSION_NOTE})", data["version"])
    try:
        return _adapter(kind).validate_python(data)  # type: ignore[no-any-return]
    except ValidationError as e:
        err = e.errors(include_url=False, include_context=False)[0]
        tp: Any = _FILES[kind]
        keys: list[Any] = []
        for key in err["loc"]:
            if _is_int_list(tp):  # an error inside a shape is reported on the shape: one value
                break
            keys.append(key)
            tp = _child(tp, key)
        if len(keys) == len(err["loc"]):
            if err["type"] == "missing":
                raise FormatError(source, _path(keys), "a value (field is missing)") from None
            if err["type"] == "string_unicode":
                raise FormatError(source, _path(keys), "a string of valid Unicode (no lone "
                                  "surrogate)", err["input"]) from None
        raise _mismatch(tp, keys, data, source) from None


# --------------------------------------------------------------------------------------------
# Validation in plain Python, of what is written
# --------------------------------------------------------------------------------------------


def _walk(tp: Any, v: Any, keys: list[Any], data: Any, source: str) -> None:
    """Raise what :func:`_validate` raises for a value it rejects, for the values an object
    can dump: the same rules, without pydantic."""
    base, kw = _split(tp)
    origin = get_origin(base)
    if is_typeddict(base):
        if not isinstance(v, dict):
            raise _mismatch(tp, keys, data, source)
        hints, required = _fields(base)
        for k, t in hints.items():
            if k in v:
                _walk(t, v[k], [*keys, k], data, source)
            elif k in required:
                raise FormatError(source, _path([*keys, k]), "a value (field is missing)")
    elif origin is list:
        if not isinstance(v, list) or len(v) < kw.get("min_length", 0):
            raise _mismatch(tp, keys, data, source)
        item = get_args(base)[0]
        for i, x in enumerate(v):
            try:
                _walk(item, x, [*keys, i], data, source)
            except FormatError:
                if _is_int_list(base):
                    raise _mismatch(tp, keys, data, source) from None
                raise
    elif origin is dict:
        if not isinstance(v, dict):
            raise _mismatch(tp, keys, data, source)
        for k, x in v.items():
            _walk(get_args(base)[1], x, [*keys, k], data, source)
    elif origin is Literal:
        if not any(v == a and isinstance(v, type(a)) and isinstance(v, bool) == isinstance(a, bool)
                   for a in get_args(base)):
            raise _mismatch(tp, keys, data, source)
    elif base is bool:
        if not isinstance(v, bool):
            raise _mismatch(tp, keys, data, source)
    elif base is str:
        if not isinstance(v, str) or len(v) < kw.get("min_length", 0):
            raise _mismatch(tp, keys, data, source)
        try:
            v.encode()
        except UnicodeEncodeError:
            raise FormatError(source, _path(keys), "a string of valid Unicode (no lone "
                              "surrogate)", v) from None
    elif base in (int, float):
        ok = (isinstance(v, int) if base is int else isinstance(v, (int, float))) \
            and not isinstance(v, bool) and math.isfinite(v)
        if not ok or ("ge" in kw and v < kw["ge"]) or ("gt" in kw and v <= kw["gt"]) \
                or ("le" in kw and v > kw["le"]):
            raise _mismatch(tp, keys, data, source)


def _check(tp: Any, v: Any, source: str) -> None:
    """Raise what :func:`_walk` raises for ``v``, a whole file's value of type ``tp``: first
    the compiled test of :func:`_valid` (a schedule of 10,000 blocks has some 50,000 values),
    and only where it fails :func:`_walk`, which names the field."""
    if not _valid(tp)(v):
        _walk(tp, v, [], v, source)


@functools.cache
def _valid(tp: Any) -> Any:
    """A function that tells whether a value is a valid ``tp``: :func:`_walk`'s rules, each
    type read once (no error to build on the way)."""
    base, kw = _split(tp)
    origin = get_origin(base)
    if is_typeddict(base):
        hints, required = _fields(base)
        fields = [(k, _valid(t), k in required) for k, t in hints.items()]

        def record(v: Any) -> bool:
            if not isinstance(v, dict):
                return False
            for k, ok, needed in fields:
                if k in v:
                    if not ok(v[k]):
                        return False
                elif needed:
                    return False
            return True
        return record
    if origin is list:
        item, least = _valid(get_args(base)[0]), kw.get("min_length", 0)
        return lambda v: isinstance(v, list) and len(v) >= least and all(map(item, v))
    if origin is dict:
        value = _valid(get_args(base)[1])
        return lambda v: isinstance(v, dict) and all(map(value, v.values()))
    if origin is Literal:
        allowed = get_args(base)
        return lambda v: any(v == a and isinstance(v, type(a))
                             and isinstance(v, bool) == isinstance(a, bool) for a in allowed)
    if base is bool:
        return lambda v: isinstance(v, bool)
    if base is str:
        least = kw.get("min_length", 0)

        def text(v: Any) -> bool:
            if not isinstance(v, str) or len(v) < least:
                return False
            try:
                v.encode()
            except UnicodeEncodeError:
                return False
            return True
        return text
    if base in (int, float):
        kinds = int if base is int else (int, float)
        ge, gt, le = kw.get("ge"), kw.get("gt"), kw.get("le")

        def number(v: Any) -> bool:
            try:
                if not isinstance(v, kinds) or isinstance(v, bool) or not math.isfinite(v):
                    return False
            except OverflowError:     # an int beyond floats: _walk's own error
                return False
            return not ((ge is not None and v < ge) or (gt is not None and v <= gt)
                        or (le is not None and v > le))
        return number
    return lambda v: True


def _read(kind: str, data: Any, source: str) -> dict[str, Any]:
    """What :func:`_validate` returns for ``data``, a file's value: where :func:`_valid`
    accepts it, built by :func:`_built` without pydantic (whose import and validator cost more
    than reading a profile of 10,000 tensors); otherwise pydantic's value, or its error."""
    tp = _FILES[kind]
    if _valid(tp)(data):
        return _built(tp)(data)  # type: ignore[no-any-return]
    return _validate(kind, data, source)


@functools.cache
def _built(tp: Any) -> Any:
    """A function from a valid value of ``tp`` (:func:`_valid`) to the value pydantic's
    validation returns for it: each record's fields only (unknown ones dropped, or kept where
    the record allows them), the missing ones at their default, numbers of ``float`` fields as
    floats; fresh containers."""
    base, _ = _split(tp)
    origin = get_origin(base)
    if is_typeddict(base):
        hints, _ = _fields(base)
        keep = _RECORDS[base][1] == "allow"
        fields = []
        for k, t in hints.items():
            kw = _split(t)[1]
            fields.append((k, _built(t), "default" in kw, kw.get("default")))

        def record(v: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for k, build, has_default, default in fields:
                if k in v:
                    out[k] = build(v[k])
                elif has_default:
                    out[k] = copy.deepcopy(default)
            if keep:
                for k, x in v.items():
                    out.setdefault(k, x)
            return out
        return record
    if origin is list:
        item = _built(get_args(base)[0])
        return lambda v: [item(x) for x in v]
    if origin is dict:
        value = _built(get_args(base)[1])
        return lambda v: {k: value(x) for k, x in v.items()}
    if base is float:
        return float
    return lambda v: v


# --------------------------------------------------------------------------------------------
# Errors as one line
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
    """The expectation of the field at ``keys``, from its JSON Schema fragment ``sub``."""
    if "const" in sub:
        text = json.dumps(sub["const"])
        return text + (f" ({sub['description']})" if "description" in sub else "")
    if "enum" in sub:
        return "one of " + "|".join(str(v) for v in sub["enum"])
    kind = sub.get("type")
    if kind == "boolean":
        return "true or false"
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


def _path(keys: Sequence[Any]) -> str:
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _shown(got: Any, sub: dict[str, Any]) -> Any:
    """The value as an error shows it: scalars and arrays where arrays belong as they are,
    anything else by its type name."""
    if got is None or isinstance(got, (str, int, float, bool)):
        return got
    if isinstance(got, list) and sub.get("type") == "array":
        return got
    return type(got).__name__


def _mismatch(tp: Any, keys: Sequence[Any], data: Any, source: str) -> FormatError:
    """The value at ``keys`` of ``data`` is not a valid ``tp``: what was expected, what was found."""
    got = data
    for k in keys:
        got = got[k]
    sub = _fragment(tp)
    return FormatError(source, _path(keys), _describe(sub, keys, data), _shown(got, sub))


# --------------------------------------------------------------------------------------------
# The checks across fields
# --------------------------------------------------------------------------------------------


def _check_profile(d: dict[str, Any], source: str) -> None:
    """What no field of a valid profile value says alone: unique names, times within forward
    and backward, the gradient bytes."""
    c = d["comm"]
    nodes = c.get("nodes", 1)
    if c["world_size"] % nodes:
        raise FormatError(source, "comm.nodes", f"a divisor of world_size ({c['world_size']})",
                          nodes)
    G = c["world_size"] // nodes
    for key in ("intra", "inter"):
        if key in c and not (nodes > 1 and G > 1):
            raise FormatError(source, f"comm.{key}", "nothing here unless comm.nodes > 1 with "
                              f"several ranks on each (nodes {nodes}, world_size "
                              f"{c['world_size']})")
    F, B = d["forward_ms"], d["backward_ms"]
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


def _check_schedule(d: dict[str, Any], source: str) -> list[int]:
    """What no field of a valid schedule value says alone, but coverage: each tensor listed
    once, a numel on every buffer or none, blocks within their buffer. Returns the numels."""
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
    if numels and len(numels) != len(d["buffers"]):
        raise FormatError(source, "buffers", "a numel on every buffer or on none")
    nodes, world = d.get("nodes", 1), d["world_size"]
    if world % nodes:
        raise FormatError(source, "nodes", f"a divisor of world_size ({world})", nodes)
    for i, k in enumerate(d["blocks"]):
        if k.get("hier"):
            if not (nodes > 1 and world // nodes > 1):
                raise FormatError(source, f"blocks[{i}].hier", "false unless nodes > 1 with "
                                  f"several ranks on each (nodes {nodes}, world_size {world})",
                                  True)
            if d.get("mode") == str(Mode.SHARDED):
                raise FormatError(source, f"blocks[{i}].hier", "false in sharded mode (its "
                                  "blocks are reduce-scattered flat)", True)
        p = f"blocks[{i}]"
        bi, s, e = k["buffer"], k["start"], k["end"]
        if bi >= len(d["buffers"]):
            raise FormatError(source, f"{p}.buffer", f"a buffer index < {len(d['buffers'])}", bi)
        if e <= s:
            raise FormatError(source, f"{p}.end", f"an offset > start ({s})", e)
        if numels and e > numels[bi]:
            raise FormatError(source, f"{p}.end", f"an offset <= the buffer's numel ({numels[bi]})", e)
    if "gathers" in d:
        _check_gathers(d["gathers"], len(d["blocks"]), d.get("mode", str(Mode.OVERLAP)), source)
    cuts = d.get("cut_pieces")
    if cuts is not None:
        if d.get("mode") == str(Mode.SHARDED):
            raise FormatError(source, "cut_pieces", "no cut_pieces in sharded mode (its compiled "
                              "graphs are cut at every piece)")
        for i in range(1, len(cuts)):
            if cuts[i] <= cuts[i - 1]:
                raise FormatError(source, f"cut_pieces[{i}]", f"ascending piece numbers (> "
                                  f"{cuts[i - 1]})", cuts[i])
        if cuts and cuts[-1] >= len(d["blocks"]) * len(d["blocks"]):
            raise FormatError(source, f"cut_pieces[{len(cuts) - 1}]", "a piece number below the "
                              "number of (first, last) block pairs", cuts[-1])
    return numels


def _check_gathers(gathers: list[list[int]], n_blocks: int, mode: str, source: str) -> None:
    """``gathers`` is sharded mode's, and lists every block index exactly once."""
    if mode != str(Mode.SHARDED):
        raise FormatError(source, "gathers", f"no gathers in {mode} mode (only sharded mode "
                          "all-gathers parameters)")
    seen: dict[int, str] = {}
    for i, grp in enumerate(gathers):
        for j, k in enumerate(grp):
            p = f"gathers[{i}][{j}]"
            if k >= n_blocks:
                raise FormatError(source, p, f"a block index < {n_blocks}", k)
            if k in seen:
                raise FormatError(source, p, f"each block in one all-gather (block {k} is also "
                                  f"in {seen[k]})", k)
            seen[k] = p
    if len(seen) != n_blocks:
        k = min(set(range(n_blocks)) - set(seen))
        raise FormatError(source, "gathers", f"every block in an all-gather (block {k} is in none)")


# --------------------------------------------------------------------------------------------
# Objects to files
# --------------------------------------------------------------------------------------------


def dump_profile(profile: Profile, source: str | None = None) -> dict[str, Any]:
    """The JSON value of a profile file holding ``profile``: optional fields at their default
    are left out. Given ``source``, the value is first checked as a reader would check it (a
    :class:`~usbyte_opt.errors.FormatError` names ``source`` and the field).

    Example::

        >>> p = Profile("toy", 2.0, 4.0, (TensorSpec("w", (4, 4), "float32", 1.0, 0.0),),
        ...             CommSpec("analytic", 2, 0.1, 1.0))
        >>> dump_profile(p)["tensors"]
        [{'name': 'w', 'shape': [4, 4], 'dtype': 'float32', 'ready_ms': 1.0, 'need_ms': 0.0}]
        >>> dump_profile(p.with_comm(CommSpec("analytic", 2, 1e9, 1.0)), "p.json")
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.FormatError: p.json: comm.alpha_ms: expected a number in [0, 3600000], got 1000000000.0
    """
    out = profile_json(profile)
    if source is not None:
        _check(ProfileFile, out, source)
        _check_profile(out, source)
    return out


def _parse_collective(c: dict[str, Any] | None) -> CollectiveCost | None:
    if c is None:
        return None
    return CollectiveCost(c["alpha_ms"], c["algbw_gbs"],
                          tuple((s["bytes"], s["ms"]) for s in c["samples"]))


def dump_schedule(schedule: Schedule, source: str | None = None) -> dict[str, Any]:
    """The JSON value of a schedule file holding ``schedule``: the known fields, then
    ``shapes`` where the schedule has them, then the fields of ``extra``. Given ``source``, the
    value is first checked as a reader would check it (as :func:`dump_profile`).

    Example::

        >>> s = Schedule("hand", "toy", "0" * 16, "f" * 16, 2, (Buffer("float32", ("w",)),),
        ...              (Block(0, 0, 16),), buffer_numel=(16,), shapes={"w": (4, 4)})
        >>> d = dump_schedule(s)
        >>> d["buffers"], d["shapes"]
        ([{'dtype': 'float32', 'tensors': ['w'], 'numel': 16}], {'w': [4, 4]})
    """
    out = schedule_json(schedule)
    if source is not None:
        _check(ScheduleFile, out, source)
        numels = _check_schedule(out, source)
        if numels:
            check_coverage(schedule, numels, source)
        check_runner(schedule, out.get("bucket_cap_mb_list"), source)
    return out


# --------------------------------------------------------------------------------------------
# Files to objects
# --------------------------------------------------------------------------------------------


def parse_profile(data: Any, source: str = "<profile>") -> Profile:
    """Validate a profile file's JSON value and build the :class:`Profile`; a
    :class:`~usbyte_opt.errors.FormatError` names ``source`` and the first bad field."""
    d = _read("profile", data, source)
    _check_profile(d, source)
    tensors = tuple(TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["ready_ms"],
                               t["need_ms"], t["update_ms"]) for t in d["tensors"])
    c = d["comm"]
    comm = CommSpec(c["backend"], c["world_size"], c["alpha_ms"], c["algbw_gbs"],
                    tuple((s["bytes"], s["ms"]) for s in c["samples"]), c["cpu_ms_per_block"],
                    c["cpu_ms_per_mb"], _parse_collective(c.get("reduce_scatter")),
                    _parse_collective(c.get("all_gather")), c["nodes"],
                    _parse_collective(c.get("intra")), _parse_collective(c.get("inter")))
    meta = dict(d["meta"])
    h = d.get("host")
    host = (HostCost(h["runtime_tensor_us"], h["runtime_block_us"], h["ddp_tensor_us"],
                     h["ddp_bucket_us"], h["launch_bound"], h["method"]) if h is not None
            else HostCost.default(meta.get("device")))
    return Profile(d["name"], d["forward_ms"], d["backward_ms"], tensors, comm, meta, host)


#: Schedule fields that become :class:`Schedule` attributes; any other is kept in ``extra``.
_SCHEDULE_KEYS = {"format", "version", "strategy", "profile", "model", "fingerprint", "world_size",
                  "nodes", "mode", "buffers", "blocks", "predicted", "shapes", "gathers",
                  "runner", "bucket_cap_mb_list", "cut_pieces"}


def parse_schedule(data: Any, source: str = "<schedule>") -> Schedule:
    """Validate a schedule file's JSON value and build the :class:`Schedule` (as
    :func:`parse_profile`)."""
    d = _validate("schedule", data, source)
    numels = _check_schedule(d, source)
    shapes = d.get("shapes")
    sched = Schedule(d["strategy"], d["profile"]["name"], d["profile"]["digest"], d["fingerprint"],
                     d["world_size"], tuple(Buffer(b["dtype"], tuple(b["tensors"])) for b in d["buffers"]),
                     tuple(Block(k["buffer"], k["start"], k["end"], k["hier"]) for k in d["blocks"]),
                     dict(d["predicted"]), tuple(numels),
                     {k: v for k, v in d.items() if k not in _SCHEDULE_KEYS}, d["mode"],
                     None if shapes is None else {n: tuple(s) for n, s in shapes.items()},
                     None if "gathers" not in d else tuple(tuple(g) for g in d["gathers"]),
                     d.get("model"), d["nodes"], d["runner"],
                     None if "cut_pieces" not in d else tuple(d["cut_pieces"]))
    if numels:
        check_coverage(sched, numels, source)
    check_runner(sched, d.get("bucket_cap_mb_list"), source)
    return sched


__all__ = ["MAX_ALGBW_GBS", "MAX_ELEMENTS", "MAX_GRADIENT_BYTES", "MAX_HOST_US", "MAX_MS", "MAX_WORLD_SIZE",
           "MIN_ALGBW_GBS", "Rule", "dump_profile", "dump_schedule", "number_range",
           "parse_profile", "parse_schedule", "profile_schema", "schedule_schema"]
