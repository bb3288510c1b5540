"""Start-up checks of the runtime (docs/design.md §5.1), run before any training collective.

1. :func:`resolve_schedule`: the schedule asked for (:func:`usbyte_opt.runtime.start.requested`
   read ``$USBYTE_SCHEDULE`` already), else the default plan (with a warning).
2. :func:`check_model`: the model's trainable tensors match the schedule; the error names the
   first tensor that differs (name, dtype, shape) and says expected vs got.
3. :func:`~usbyte_opt.collectives.agree.agree`: every rank all-gathers one fixed-size record
   (schedule digest, or the error its own checks raised) *before any other collective*, so
   that a rank whose checks failed still takes part, and every rank raises the same clear
   error instead of hanging. The profiler agrees the same way that every rank built its model.
4. :func:`broadcast_from_rank0`: parameters (and buffers) copied from rank 0.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..collectives.agree import wait
from ..env import SCHEDULE_ENV
from ..errors import MismatchError, UsbyteError
from ..formats import Mode, Schedule, fingerprint, load_schedule
from ..models.registry import MODEL_NAME_ATTR
from ..voice import launched
from .default_plan import default_schedule

#: Bytes of the record every rank all-gathers at start-up (digest plus a truncated error).
RECORD_BYTES = 512


class UsbyteWarning(UserWarning):
    """Something works but not as planned: no schedule, a schedule made for another world size."""


def resolve_schedule(schedule: Schedule | str | os.PathLike | None, model: torch.nn.Module,
                     world_size: int, warn: bool = True) -> tuple[Schedule, str]:
    """The schedule to run and where it came from: its path (also of a :class:`Schedule` read
    from a file, :func:`schedule_source`), carrying the label of ``model`` for
    :func:`check_model`'s message.

    Raises:
        FormatError: the file is missing or malformed (names the file and field).
    """
    if isinstance(schedule, Schedule):
        return schedule, _Source(schedule_source(schedule), model)
    if schedule is not None:
        return load_schedule(schedule), _Source(str(Path(schedule)), model)
    if warn:
        warnings.warn(f"no schedule given (argument or ${SCHEDULE_ENV}): using a default "
                      "DDP-like plan of 1 MiB + 25 MiB buckets; run `usbyte-opt optimize` for a "
                      "planned one", UsbyteWarning, stacklevel=3)
    return default_schedule(model, world_size), "<default schedule>"


def schedule_source(schedule: Schedule) -> str:
    """How messages name a schedule object: the file it was read from, else (one built in
    memory) ``<STRATEGY schedule>``.

    Example::

        >>> import torch
        >>> schedule_source(default_schedule(torch.nn.Linear(2, 2)))
        '<default schedule>'
    """
    if schedule.path:
        return str(Path(schedule.path))
    return f"<{schedule.strategy} schedule>"


def model_label(model: torch.nn.Module) -> str:
    """What a message calls a model: the registry name it was built under
    (:func:`usbyte_opt.models.build` records it), else its class name.

    Example::

        >>> model_label(torch.nn.Linear(2, 2))
        'Linear'
    """
    name = getattr(model, MODEL_NAME_ATTR, None)
    return name if isinstance(name, str) and name else type(model).__name__


class _Source(str):
    """A schedule's source (its path) that also carries the label of the model it is checked
    against, so that :func:`check_model` can name both."""

    model: str | None

    def __new__(cls, text: str, model: torch.nn.Module | None = None) -> _Source:
        self = super().__new__(cls, text)
        self.model = None if model is None else model_label(model)
        return self


def _mismatch(schedule: Schedule, source: str, model: str | None, detail: str) -> MismatchError:
    """The one error of a schedule that does not fit the model: what it was planned for and
    what the model is, then the first difference (``detail``)."""
    planned = schedule.model or (schedule.profile_name and f"the profile {schedule.profile_name!r}")
    model = model or getattr(source, "model", None)
    if planned and model and planned.split(" (")[0] != model:
        article = "an" if model[:1].lower() in "aeio" else "a"
        head = f"{source} was planned for {planned}; this model is {article} {model}"
    elif planned:
        head = f"{source} was planned for {planned}; this model differs from it"
    else:
        head = f"{source} does not fit this model"
    return MismatchError(f"{head} ({detail})")


def check_model(schedule: Schedule, tensors: Sequence[tuple[str, tuple[int, ...], str]],
                source: str, model: str | None = None) -> None:
    """Raise :class:`MismatchError` unless ``tensors`` (name, shape, dtype) are the schedule's.

    Names are checked first (a tensor of the model missing from the schedule, then one of the
    schedule missing from the model), then dtypes, then shapes: per tensor when the schedule
    records ``shapes`` (an extra field the default plan writes), else per buffer by element
    count, and finally the fingerprint itself. The error says what the schedule was planned
    for (its ``model`` field, else its profile's name) and what ``model`` is (a label such as
    :func:`model_label`'s; default: the one :func:`resolve_schedule`'s ``source`` carries).

    Example::

        >>> import torch
        >>> from usbyte_opt.runtime.default_plan import model_tensors
        >>> s = default_schedule(torch.nn.Linear(3, 2))
        >>> check_model(s, model_tensors(torch.nn.Linear(3, 2)), "s.json")   # matches
        >>> check_model(s, model_tensors(torch.nn.Linear(4, 2)), "s.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.MismatchError: s.json was planned for the profile 'model'; ... got [2, 4] (model))
    """
    def fail(detail: str) -> MismatchError:
        return _mismatch(schedule, source, model, detail)

    mine = {n: (tuple(s), d) for n, s, d in tensors}
    where: dict[str, tuple[int, int]] = {}
    for b, buf in enumerate(schedule.buffers):
        for j, n in enumerate(buf.tensors):
            where[n] = (b, j)
    for n in mine:
        if n not in where:
            raise fail(f"tensor {n!r}: the model trains it, the schedule does not list it "
                       f"(schedule fingerprint {schedule.fingerprint}; model {fingerprint(tensors)})")
    for n, (b, j) in where.items():
        if n not in mine:
            raise fail(f"buffers[{b}].tensors[{j}]: tensor {n!r} is not a trainable parameter of "
                       "the model (frozen, renamed or absent)")
    # Tensors in the model's registration order: "first" as the user reads the model.
    for n, _shape, dt in tensors:
        b = where[n][0]
        if dt != schedule.buffers[b].dtype:
            raise fail(f"tensor {n!r}: expected dtype {schedule.buffers[b].dtype} (schedule "
                       f"buffers[{b}]), got {dt} (model)")
    shapes = schedule.shapes
    if shapes is not None:
        for n, shape, _ in tensors:
            want = shapes.get(n)
            if want is not None and list(want) != list(shape):
                raise fail(f"tensor {n!r}: expected shape {list(want)} (schedule), got "
                           f"{list(shape)} (model)")
    if schedule.buffer_numel:
        for b, buf in enumerate(schedule.buffers):
            got = sum(math.prod(mine[n][0]) for n in buf.tensors)
            if got != schedule.buffer_numel[b]:
                raise fail(f"buffers[{b}]: expected {schedule.buffer_numel[b]} elements (schedule), "
                           f"got {got} (model): a shape of one of its {len(buf.tensors)} "
                           f"{buf.dtype} tensors differs (the schedule records no per-tensor "
                           "shapes to name it)")
    fp = fingerprint(tensors)
    if fp != schedule.fingerprint:
        raise fail(f"fingerprint: expected {schedule.fingerprint} (schedule), got {fp} (model): "
                   "names and dtypes agree, so a tensor shape differs")


_HINT = ("pass the plain module and do not wrap it (the runtime averages the gradients itself, "
         "so they would be averaged twice); for stock DDP with planned buckets use "
         "usbyte_opt.ddp.planned_ddp_kwargs(schedule) where DDP is built, or usbyte_opt.ddp.wrap")


def _wrapper_classes() -> dict[type, str]:
    """The data-parallel wrapper classes of this torch, by the name an error gives them."""
    found: dict[type, str] = {DistributedDataParallel: "DistributedDataParallel"}
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        found[FullyShardedDataParallel] = "FullyShardedDataParallel (FSDP)"
    except ImportError:  # pragma: no cover - builds without FSDP
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        found[FSDPModule] = "fully_shard (FSDP2)"
    except ImportError:  # pragma: no cover - torch before FSDP2's public home
        pass
    return found


def _sharded_param(p: torch.Tensor) -> str | None:
    if getattr(p, "_is_flat_param", False) or type(p).__name__ == "FlatParameter":
        return "FullyShardedDataParallel (FSDP)"
    if type(p).__name__ == "DTensor" or "DTensor" in (c.__name__ for c in type(p).__mro__):
        return "fully_shard (FSDP2) or another DTensor sharding"
    return None


def check_not_wrapped(model: torch.nn.Module) -> None:
    """Raise :class:`~usbyte_opt.errors.UsbyteError` if ``model`` is or contains
    ``DistributedDataParallel`` or FSDP, or holds parameters sharded by FSDP: the runtime
    averages the gradients itself. A wrapper built around the model (before or after the
    runtime) is found when it runs the model's forward (:func:`wrapped_now`): only a forward
    through it would average the gradients twice, and no scan of live objects is needed.

    Example::

        >>> import torch
        >>> check_not_wrapped(torch.nn.Linear(2, 2))   # a plain module
    """
    classes = _wrapper_classes()
    kinds = tuple(classes)

    def name_of(obj: object) -> str:
        return next(v for k, v in classes.items() if isinstance(obj, k))

    for sub_name, sub in model.named_modules():
        if isinstance(sub, kinds):
            where = "the model is" if sub is model else f"its submodule {sub_name!r} is"
            raise UsbyteError(f"model: expected a plain module, but {where} wrapped in "
                              f"{name_of(sub)}: {_HINT}")
    for pname, p in model.named_parameters():
        kind = _sharded_param(p)
        if kind:
            raise UsbyteError(f"model: parameter {pname!r} is sharded by {kind}: the runtime "
                              "averages whole gradients of plain parameters; pass the unsharded "
                              "module")


def wrapped_now(model: torch.nn.Module, params: Mapping[str, torch.Tensor] | None) -> str:
    """What is wrong when ``model`` runs a forward now ('' if nothing): inside a DDP forward,
    or (with ``params``, the tensors the optimizer was built with) its parameters replaced, as
    FSDP does when it wraps a model. Cheap: one attribute read unless ``params`` is given."""
    active = getattr(DistributedDataParallel, "_active_ddp_module", None)
    # (The runtime's marker for dynamo's DDP hook is no DDP module: .compiled.)
    if isinstance(active, torch.nn.Module) and any(m is model for m in active.modules()):
        return (f"the model runs inside DistributedDataParallel (wrapped after the "
                f"DistributedOptimizer was built): {_HINT}")
    if params is not None:
        now = dict(model.named_parameters())
        for name, p in params.items():
            q = now.get(name)
            if q is not p:
                kind = _sharded_param(q) if q is not None else None
                return (f"the model's parameter {name!r} is no longer the one the "
                        f"DistributedOptimizer was built with ({'sharded by ' + kind if kind else 'replaced'} "
                        "after it was built): build the optimizer on the module as it trains, "
                        "not wrapped in FSDP")
    return ""


def check_world_size(schedule: Schedule, world_size: int, rank: int) -> None:
    """Warn (rank 0 only) when the schedule was planned for another world size: the order stays
    valid, only the predicted timing does not carry over. The warning gives the schedule's
    prediction at its planned size and how to re-predict (``usbyte-opt launch`` does it from
    the profile when that is at hand, and under it the ranks leave the warning to it)."""
    if schedule.world_size != world_size and rank == 0 and not launched():
        planned = (schedule.predicted or {}).get("iteration_ms")
        there = (f"predicted {planned:.1f} ms per iteration at {schedule.world_size}, not "
                 f"re-predicted for {world_size} (`usbyte-opt simulate PROFILE SCHEDULE "
                 f"--world-size {world_size}` does)" if planned else "its timing was predicted "
                 "for the other size")
        warnings.warn(f"schedule was planned for world size {schedule.world_size}, running with "
                      f"{world_size}: {there}; the block order stays valid; re-plan with "
                      f"`usbyte-opt optimize PROFILE --world-size {world_size}` for this size",
                      UsbyteWarning, stacklevel=3)


def check_hierarchy(schedule: Schedule, world_size: int, source: str,
                    env: Mapping[str, str] | None = None, rank: int | None = None,
                    whole_world: bool = True) -> None:
    """Raise :class:`~usbyte_opt.errors.MismatchError` unless the hierarchical blocks of
    ``schedule`` (:attr:`~usbyte_opt.formats.Block.hier`) can run on ``world_size`` ranks
    here: not in sharded mode, ``nodes`` a divisor of the world size with several ranks on
    each node, and, when the ranks run the whole world (``whole_world``) and torchrun's
    ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` / ``LOCAL_RANK`` are set (``env``, default
    ``os.environ``), nodes of ``LOCAL_WORLD_SIZE`` ranks with this rank (default: its global
    rank) on node ``GROUP_RANK``. A schedule without hierarchical blocks passes. Run among
    the start-up checks, so every rank raises (:func:`~usbyte_opt.collectives.agree.agree`).

    Example::

        >>> from usbyte_opt.formats import Block, Buffer, Schedule
        >>> s = Schedule("s", "p", "0" * 16, "f" * 16, 4, (Buffer("float32", ("a",)),),
        ...              (Block(0, 0, 4, hier=True),), nodes=2)
        >>> check_hierarchy(s, 4, "s.json", {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, rank=3)
        >>> check_hierarchy(s, 4, "s.json", {"LOCAL_WORLD_SIZE": "4"}, rank=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.MismatchError: s.json: nodes: expected 1 to match this launch ... got 2 ...
    """
    if not schedule.hierarchical:
        return
    nodes = schedule.nodes
    if schedule.mode == Mode.SHARDED:
        i = next(i for i, b in enumerate(schedule.blocks) if b.hier)
        raise MismatchError(f"{source}: blocks[{i}].hier: expected false in sharded mode (its "
                            "blocks are reduce-scattered over the whole group), got True")
    if nodes < 2 or world_size % nodes or world_size // nodes < 2:
        raise MismatchError(f"{source}: nodes: expected a divisor of the world size "
                            f"({world_size}) that leaves several ranks on each node, for its "
                            f"hierarchical blocks, got {nodes}")
    g = world_size // nodes
    if not whole_world:
        return
    env = os.environ if env is None else env
    if rank is None:
        rank = dist.get_rank()
    fix = f"plan for this launch, or launch {nodes} nodes of {g} ranks"

    def read(name: str) -> int | None:
        try:
            return int(env[name]) if env.get(name) else None
        except ValueError:
            return None

    lws, group_rank, local_rank = read("LOCAL_WORLD_SIZE"), read("GROUP_RANK"), read("LOCAL_RANK")
    if lws is not None and lws != g:
        want = f"{world_size // lws}" if lws > 0 and world_size % lws == 0 else "a divisor"
        raise MismatchError(f"{source}: nodes: expected {want} to match this launch (world size "
                            f"{world_size}, LOCAL_WORLD_SIZE {lws} ranks per node), got {nodes} "
                            f"({g} ranks per node); {fix}")
    if group_rank is not None and group_rank != rank // g:
        raise MismatchError(f"{source}: nodes: expected rank {rank} on node {rank // g} (node k "
                            f"holds ranks k*{g} .. k*{g}+{g - 1}), but GROUP_RANK is "
                            f"{group_rank}; launch the ranks numbered as torchrun numbers them")
    if local_rank is not None and lws is not None and local_rank != rank % g:
        raise MismatchError(f"{source}: nodes: expected rank {rank} to be local rank "
                            f"{rank % g} of its node, but LOCAL_RANK is {local_rank}; launch "
                            "the ranks numbered as torchrun numbers them")


def whole_world(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (``None``: the default group) holds every rank of the job, so that
    torchrun's per-node variables describe its ranks (:func:`check_hierarchy`)."""
    return group is None or dist.get_world_size(group) == dist.get_world_size()


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None,
                         timeout: timedelta | None, what: str = "parameters",
                         chunk_bytes: int = 64 << 20) -> None:
    """Overwrite ``tensors`` with rank 0's values, in flat chunks of one dtype and device (few
    collectives).

    A CPU tensor never goes to a group whose backend takes none (NCCL): its chunks travel
    through the current CUDA device, copied there for the broadcast and back, which needs no
    second (gloo) group and so no extra collective to create one; on a backend that takes CPU
    tensors (gloo, or a ``cpu:gloo,cuda:nccl`` group) they are broadcast where they are.

    Example::

        >>> import torch, torch.distributed as dist, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> t = torch.ones(3)
        >>> broadcast_from_rank0([t], None, None)
        >>> dist.destroy_process_group()
    """
    ws = dist.get_world_size(group)
    if ws == 1 or not tensors:
        return
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    backend = str(dist.get_backend(group)).lower()
    takes_cpu = (any(item.split(":", 1)[0].strip() == "cpu" for item in backend.split(","))
                 if ":" in backend else backend != "nccl")
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        chunk: list[torch.Tensor] = []
        size = 0
        items: list[torch.Tensor | None] = [*ts, None]   # None: flush the last chunk
        for x in items:
            if x is not None:
                chunk.append(x)
                size += x.numel() * x.element_size()
            if chunk and (x is None or size >= chunk_bytes):
                with torch.no_grad():
                    flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                    if flat.device.type == "cpu" and not takes_cpu:   # NCCL: via the GPU
                        flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
                    wait(dist.broadcast(flat, src, group=group, async_op=True),
                         f"broadcast of {what} from rank 0", rank, timeout)
                    if rank != 0:
                        off = 0
                        for c in chunk:
                            c.copy_(flat[off: off + c.numel()].view_as(c))
                            off += c.numel()
                chunk, size = [], 0


def require_initialized() -> None:
    """Refuse to start before ``torch.distributed.init_process_group()``."""
    if not dist.is_available() or not dist.is_initialized():
        raise UsbyteError("torch.distributed is not initialized: call "
                          "torch.distributed.init_process_group() first (or start the script "
                          "with `usbyte-opt launch`)")
