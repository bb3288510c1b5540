"""A schedule's blocks as the arguments of torch's own compiled gradient bucketing.

PyTorch 2.13 can bucket gradient collectives itself, inside a compiled graph. Three knobs
take bucket plans; this module turns a loaded :class:`~usbyte_opt.formats.Schedule` into the
argument each one takes, or refuses in one line (:class:`~usbyte_opt.errors.UsbyteError`,
``source: field: ...``) where the knob cannot express the schedule. Nothing here imports
torch at module level: computing the arguments needs none, and only the functions that touch
torch's configuration import it.

* **Inductor's FX all-reduce bucketing** (``torch._inductor.config.bucket_all_reduces_fx`` and
  ``bucket_all_reduces_fx_bucket_size_determinator``, the post-grad pass
  ``torch._inductor.fx_passes.bucketing.bucket_all_reduce``): a size cap by bucket index in
  graph order, of which torch 2.13 reads only bucket 0's and closes every bucket at it.
  :func:`inductor_bucket_bytes` gives the planned sizes, :func:`inductor_bucket_size_determinator`
  the callback (one cap that rebuilds the plan, or a one-line refusal where none does),
  :func:`inductor_all_reduce_buckets` installs it for the duration of a ``with`` block. This
  is also how a plan reaches compiled autograd with DDP's python reducer
  (``torch._dynamo.config.optimize_ddp = "python_reducer"``), whose all-reduces that pass
  buckets.
* **The manual overlap scheduler's module bucket plans**
  (``torch._inductor.fx_passes.overlap_manual_scheduling.manual_overlap_bucketing(gm,
  module_bucket_plans)``): groups of module names whose collectives go in one bucket.
  :func:`module_bucket_plans` gives them where the plan's blocks are whole modules.
* **DDP's reducer** (``DistributedDataParallel(bucket_cap_mb_list=...)``, eager or under
  ``torch.compile`` with the default ``optimize_ddp``): :func:`ddp_bucket_cap_mb_list`, the
  existing conversion (:func:`usbyte_opt.planning.ddp.bucket_caps_mb`). DDP refuses that list
  with the python reducer; use the inductor callback there.

What none of them can express: the usbyte-opt runtime's own semantics. Overlap mode (each
update right before its tensor's first use in the next forward) has no counterpart: a
compiled step updates after the backward's collectives, as in fence mode. Cut tensors: a
compiled graph all-reduces whole gradients. Hierarchical blocks: every collective runs on the
graph's one group. docs/compiled_buckets.md has the whole table.

Example (a fence-mode schedule of three bias-free layers, gradients ready last layer first)::

    >>> from usbyte_opt.formats import Block, Buffer, Schedule
    >>> s = Schedule("ddp-tuned", "p", "0" * 16, "f" * 16, 2,
    ...              (Buffer("float32", ("l2.weight", "l1.weight", "l0.weight")),),
    ...              (Block(0, 0, 48), Block(0, 48, 64)), mode="fence",
    ...              shapes={"l2.weight": (4, 4), "l1.weight": (8, 4), "l0.weight": (4, 4)})
    >>> inductor_bucket_bytes(s)                              # 2 tensors, then 1: bytes
    [192, 64]
    >>> caps = inductor_bucket_size_determinator(s)           # one cap: 192 + 64 > 192 closes
    >>> [int(caps(i) * 2**20) for i in range(3)]              # MiB caps as inductor reads them
    [192, 192, 0]
    >>> caps = inductor_bucket_size_determinator(s, per_bucket=True)
    >>> [int(caps(i) * 2**20) for i in range(3)]
    [192, 64, 0]
    >>> module_bucket_plans(s)
    [['l2', 'l1'], ['l0']]
    >>> [int(c * 2**20) for c in ddp_bucket_cap_mb_list(s)]  # DDP closes at >=, so one byte less
    [191, 63]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import UsbyteError
from .formats import DTYPE_SIZES, Mode, Profile, Schedule
from .planning.ddp import MIB, bucket_caps_mb

#: What inductor's FX all-reduce bucketing gets for bucket indices past the plan's last
#: block: 0 MiB, so that any all-reduce the plan does not know of stays alone.
BEYOND_PLAN_MB = 0.0


# --------------------------------------------------------------------------------------------
# Shared checks
# --------------------------------------------------------------------------------------------


def _load(schedule: Schedule | str | os.PathLike[str], source: str | None) -> tuple[Schedule, str]:
    """The schedule (read from its path if one is given) and its name in messages."""
    if not isinstance(schedule, Schedule):
        from .formats import load_schedule

        return load_schedule(schedule), source or str(schedule)
    return schedule, source or schedule.path or "<schedule>"


def _shapes(schedule: Schedule, profile: Profile | None, source: str) -> Mapping[str, Sequence[int]]:
    """Every tensor's shape: the schedule's ``shapes`` field, else the profile's tensors."""
    if schedule.shapes is not None:
        return schedule.shapes
    if profile is not None:
        return {t.name: t.shape for t in profile.tensors}
    raise UsbyteError(f"{source}: shapes: expected the per-tensor shapes (schedules written by "
                      "`usbyte-opt optimize` record them), or pass the profile")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _block_tensors(schedule: Schedule, shapes: Mapping[str, Sequence[int]], source: str,
                   knob: str) -> list[list[str]]:
    """Each block's tensors (buffer order), or a one-line error naming the block that cuts a
    tensor or is hierarchical: ``knob`` collectives carry whole gradients on one group."""
    starts: list[dict[int, int]] = []
    ends: list[dict[int, int]] = []
    for b, buf in enumerate(schedule.buffers):
        s: dict[int, int] = {}
        e: dict[int, int] = {}
        off = 0
        for i, name in enumerate(buf.tensors):
            if name not in shapes:
                raise UsbyteError(f"{source}: shapes: expected a shape for buffers[{b}]'s tensor "
                                  f"{name!r}, which has none")
            s[off] = i
            off += _numel(shapes[name])
            e[off] = i
        starts.append(s)
        ends.append(e)
    out: list[list[str]] = []
    for k, blk in enumerate(schedule.blocks):
        if blk.hier:
            raise UsbyteError(f"{source}: blocks[{k}].hier: expected false: {knob} runs every "
                              "collective on the graph's one group (no hierarchical blocks)")
        s, e = starts[blk.buffer], ends[blk.buffer]
        if blk.start not in s or blk.end not in e or blk.end <= blk.start:
            raise UsbyteError(f"{source}: blocks[{k}]: expected whole tensors: {knob} buckets "
                              f"whole gradients and cannot cut a tensor, got [{blk.start}, "
                              f"{blk.end}) which cuts one")
        out.append(list(schedule.buffers[blk.buffer].tensors[s[blk.start]: e[blk.end] + 1]))
    return out


# --------------------------------------------------------------------------------------------
# (a) inductor's FX all-reduce bucketing
# --------------------------------------------------------------------------------------------

_INDUCTOR = "inductor's FX all-reduce bucketing"


def _inductor_blocks(schedule: Schedule | str | os.PathLike[str], profile: Profile | None,
                     source: str | None) -> tuple[list[list[int]], str]:
    """Each block's tensors' bytes, in graph order, and the schedule's name in messages; or
    the one-line refusal of :func:`inductor_bucket_bytes`."""
    schedule, source = _load(schedule, source)
    if schedule.mode is not Mode.FENCE:
        why = ("reduce-scatters, not all-reduces" if schedule.mode is Mode.SHARDED else
               "per-tensor updates before the next forward are the usbyte-opt runtime's")
        raise UsbyteError(f"{source}: mode: expected \"fence\" ({_INDUCTOR} runs a compiled step "
                          f"that updates after its all-reduces), got {str(schedule.mode)!r}: {why}")
    if len(schedule.buffers) != 1:
        raise UsbyteError(f"{source}: buffers: expected one buffer (one dtype): {_INDUCTOR} "
                          "restarts its bucket index for each dtype, so one callback cannot size "
                          f"{len(schedule.buffers)} ({', '.join(b.dtype for b in schedule.buffers)})")
    shapes = _shapes(schedule, profile, source)
    names = _block_tensors(schedule, shapes, source, _INDUCTOR)
    pos = 0
    for k, blk in enumerate(schedule.blocks):
        if blk.start != pos:
            raise UsbyteError(f"{source}: blocks[{k}]: expected a block starting at element {pos}: "
                              f"{_INDUCTOR} buckets adjacent all-reduces in graph order, so blocks "
                              f"follow the buffer's (gradient-ready) order; got start {blk.start}")
        pos = blk.end
    if profile is not None:
        ready = {t.name: t.ready_ms for t in profile.tensors}
        order = schedule.buffers[0].tensors
        for i in range(1, len(order)):
            if ready.get(order[i], 0.0) < ready.get(order[i - 1], 0.0):
                raise UsbyteError(f"{source}: buffers[0].tensors: expected gradient-ready order "
                                  f"(the graph's): {order[i]!r} is ready before {order[i - 1]!r}")
    size = DTYPE_SIZES[schedule.buffers[0].dtype]
    return [[_numel(shapes[n]) * size for n in block] for block in names], source


def inductor_bucket_bytes(schedule: Schedule | str | os.PathLike[str], profile: Profile | None = None,
                          source: str | None = None) -> list[int]:
    """The bytes of each bucket that inductor's FX all-reduce bucketing must build, in graph
    order: one per block, the blocks' order (what the plan says; whether torch's pass can be
    made to build it is :func:`inductor_bucket_size_determinator`'s question).

    How the pass buckets (``torch._inductor.fx_passes.bucketing.greedy_bucket_collective_by_mb``,
    torch 2.13): it walks the graph's all-reduce waits in graph order, in runs of adjacent
    all-reduces of one group, reduce op and dtype; in each run an all-reduce that would take
    the open bucket *past* ``int(cap_mb * 1024 * 1024)`` bytes starts the next bucket. A
    bucket of one all-reduce is left as it is (but still counts as a bucket).

    **Cannot express**, refused in one line naming the field: ``mode`` overlap (per-tensor
    updates before the next forward are the usbyte-opt runtime's) or sharded (reduce-scatters,
    not all-reduces); several ``buffers`` (the pass buckets each dtype's run apart and counts
    its buckets from 0 again); ``blocks[k]`` that cut a tensor, are hierarchical, or do not
    follow the buffer from its start (the pass buckets adjacent all-reduces in graph order
    only). With ``profile``, a buffer whose tensors are not in gradient-ready order
    (``buffers[0].tensors``) is refused too; without it, the buffer's order is taken as the
    graph's. Which tensors fall in a bucket follows from the graph's order, which must be the
    profile's gradient-ready order. The pass's order is that of the all-reduces' *waits*:
    compiled autograd issues the all-reduces as gradients become ready, but a graph may place
    a wait later, at its use (the slow test in ``tests/test_compiled_buckets.py`` shows one
    that does); a boundary between two tensors whose waits come in the other order gives
    other buckets.

    Args:
        schedule: a loaded schedule, or its path.
        profile: where the schedule has no ``shapes``, their source; also checks the order.
        source: the schedule's name in errors (default: its path, or ``<schedule>``).

    Raises:
        UsbyteError: the schedule is one the pass cannot build (above).
    """
    return [sum(block) for block in _inductor_blocks(schedule, profile, source)[0]]


@dataclass(frozen=True)
class BucketSizeDeterminator:
    """The callback inductor's FX bucketing takes (``bucket_all_reduces_fx_bucket_size_determinator``,
    called as ``bucket_cap_mb_by_bucket_idx(bucket_id) -> float``): the cap, in MiB, of bucket
    ``bucket_id``, counted from 0 in graph order; past the plan, :data:`BEYOND_PLAN_MB`. A
    module-level frozen dataclass, so that inductor's cache key pickles it (a lambda cannot be
    pickled, and inductor then skips its graph cache) and two plans give two keys.

    ``caps_mb[i]`` is a whole number of bytes plus half a byte, in MiB, so that
    ``int(cap * 2**20)`` is that number exactly.
    """

    caps_mb: tuple[float, ...]

    @classmethod
    def of_bytes(cls, sizes: Sequence[int]) -> BucketSizeDeterminator:
        """The callback whose bucket ``i`` has a cap of exactly ``sizes[i]`` bytes."""
        return cls(tuple((int(n) + 0.5) / MIB for n in sizes))

    def __call__(self, bucket_id: int) -> float:
        return self.caps_mb[bucket_id] if 0 <= bucket_id < len(self.caps_mb) else BEYOND_PLAN_MB

    def bucket_bytes(self) -> list[int]:
        """The caps, in bytes, as inductor reads them."""
        return [int(c * MIB) for c in self.caps_mb]


def inductor_bucket_size_determinator(schedule: Schedule | str | os.PathLike[str],
                                      profile: Profile | None = None, source: str | None = None, *,
                                      per_bucket: bool = False) -> BucketSizeDeterminator:
    """The ``bucket_all_reduces_fx_bucket_size_determinator`` that makes inductor's FX
    all-reduce bucketing build the schedule's blocks as its buckets.

    **Torch 2.13 asks for one cap.** The callback's contract is a cap per bucket index, but
    torch 2.13's pass calls it once per run of adjacent all-reduces, for bucket 0, and closes
    *every* bucket of the run at that cap (``greedy_bucket_collective_by_mb`` does not ask
    again as the index grows). So by default this gives one cap ``C``, the largest block's
    bytes, for every index of the plan, and refuses a plan that ``C`` does not rebuild: the
    pass closes a bucket only when the next all-reduce would take it past ``C``, so every
    block but the last, with the next block's first tensor added, must exceed ``C``
    (``blocks[k]`` names the first block that would not close). Plans of near-equal buckets
    pass; a plan with a small early bucket and larger later ones (what ``ddp-tuned`` often
    picks) does not. The same callback is right for a pass that asks per bucket.

    ``per_bucket=True``: bucket ``i``'s cap is exactly block ``i``'s bytes, the callback's
    documented contract, for a torch whose pass asks per bucket; with torch 2.13's pass every
    bucket then gets block 0's size, which is not the plan unless the blocks are equal.

    Raises what :func:`inductor_bucket_bytes` raises (which says what else it cannot
    express), and, without ``per_bucket``, ``blocks[k]`` for a plan one cap cannot rebuild.
    """
    blocks, source = _inductor_blocks(schedule, profile, source)
    sizes = [sum(block) for block in blocks]
    if per_bucket:
        return BucketSizeDeterminator.of_bytes(sizes)
    cap = max(sizes, default=0)
    for k in range(len(blocks) - 1):
        if sizes[k] + blocks[k + 1][0] <= cap:
            raise UsbyteError(f"{source}: blocks[{k}]: expected a block that one cap "
                              f"closes ({_INDUCTOR} in torch 2.13 closes every bucket at the cap "
                              f"of bucket 0): block {k} of {sizes[k]} bytes and the next block's "
                              f"first tensor ({blocks[k + 1][0]} bytes) fit under the largest "
                              f"block ({cap} bytes), so the bucket would not close there")
    return BucketSizeDeterminator.of_bytes([cap] * len(sizes))


@contextmanager
def inductor_all_reduce_buckets(schedule: Schedule | str | os.PathLike[str], profile: Profile | None = None,
                                source: str | None = None, *, per_bucket: bool = False,
                                replace_ddp_fusion: bool = True) -> Iterator[BucketSizeDeterminator]:
    """Compile with the schedule's all-reduce buckets: inside the block,
    ``torch._inductor.config.bucket_all_reduces_fx = "all"`` and
    ``bucket_all_reduces_fx_bucket_size_determinator`` is
    :func:`inductor_bucket_size_determinator` (``per_bucket`` as there); both are restored on
    exit (``config.patch``). Inductor reads them when it compiles a graph, so the first call
    of the compiled step (and any recompilation) must run inside::

        with inductor_all_reduce_buckets(schedule):
            loss = compiled_model(x).sum()
            loss.backward()          # compiled autograd: the backward graph's all-reduces

    With DDP's python reducer (``optimize_ddp = "python_reducer"``) DDP turns on its own fusion
    of the backward's all-reduces (``config._fuse_ddp_communication``, one cap for every
    bucket), which runs before this pass; ``replace_ddp_fusion`` (default) turns it off inside
    the block, so that the plan's buckets are the ones built. Build DDP before entering (its
    constructor turns the fusion back on).

    Yields the callback installed. Raises what :func:`inductor_bucket_size_determinator`
    raises, before anything is changed.
    """
    determinator = inductor_bucket_size_determinator(schedule, profile, source, per_bucket=per_bucket)
    from torch._inductor import config

    changes: dict[str, object] = {"bucket_all_reduces_fx": "all",
                                  "bucket_all_reduces_fx_bucket_size_determinator": determinator}
    if replace_ddp_fusion:
        changes["_fuse_ddp_communication"] = False
    with config.patch(changes):
        yield determinator


# --------------------------------------------------------------------------------------------
# (b) the manual overlap scheduler's module bucket plans
# --------------------------------------------------------------------------------------------

_MANUAL = "the manual overlap scheduler"


def module_bucket_plans(schedule: Schedule | str | os.PathLike[str], profile: Profile | None = None,
                        source: str | None = None) -> list[list[str]]:
    """The ``module_bucket_plans`` of ``manual_overlap_bucketing(gm, module_bucket_plans)``
    (``torch._inductor.fx_passes.overlap_manual_scheduling``): one group of module names
    (fully qualified, as in ``model.named_modules()``) per block, in block order. Each group
    names the largest modules whose trainable tensors all lie in that block, so that the
    group's subgraph (a module's nodes include its submodules') holds exactly the block's
    tensors.

    **Can express:** a plan whose blocks are whole modules: every tensor's module (the name
    less its last part) has all its tensors, its submodules' included, in one block. Fence
    mode, or sharded mode with one all-gather per block (the scheduler buckets a module
    group's all-gathers as it buckets its reduce-scatters). Several buffers (each block is of
    one dtype; the scheduler buckets each dtype of a group apart).

    **Cannot express**, refused in one line naming the field: ``mode`` overlap; ``gathers``
    that group several blocks; ``blocks[k]`` that cut a tensor, are hierarchical, or split a
    module across blocks; a parameter of the root module itself (``buffers[b].tensors``: a
    plan names submodules). Sizes and order: the scheduler buckets by module, whatever the
    bytes, and orders by the graph. Collective kinds: in torch 2.13 it buckets FSDP-style
    all-gathers and reduce-scatters only (SimpleFSDP graphs), and leaves all-reduces as they
    are: bucket those with :func:`inductor_all_reduce_buckets`.

    Args:
        schedule: a loaded schedule, or its path.
        profile: where the schedule has no ``shapes``, their source.
        source: the schedule's name in errors (default: its path, or ``<schedule>``).

    Raises:
        UsbyteError: the schedule is one module groups cannot express (above).
    """
    schedule, source = _load(schedule, source)
    if schedule.mode is Mode.OVERLAP:
        raise UsbyteError(f"{source}: mode: expected \"fence\" or \"sharded\" ({_MANUAL} runs a "
                          "compiled step that updates after its collectives), got 'overlap': "
                          "per-tensor updates before the next forward are the usbyte-opt runtime's")
    if schedule.mode is Mode.SHARDED:
        for g, gathered in enumerate(schedule.gather_groups()):
            if len(gathered) != 1:
                raise UsbyteError(f"{source}: gathers[{g}]: expected one block per all-gather: "
                                  f"{_MANUAL} buckets a module group's all-gathers as its "
                                  f"reduce-scatters, got blocks {list(gathered)}")
    shapes = _shapes(schedule, profile, source)
    names = _block_tensors(schedule, shapes, source, _MANUAL)
    block_of = {n: k for k, block in enumerate(names) for n in block}
    for b, buf in enumerate(schedule.buffers):
        for n in buf.tensors:
            if "." not in n:
                raise UsbyteError(f"{source}: buffers[{b}].tensors: expected tensors of submodules: "
                                  f"{n!r} is the root module's own, and module plans name submodules")
    # The blocks each module's tensors (its submodules' included) lie in.
    spans: dict[str, set[int]] = {}
    for n, k in block_of.items():
        parts = n.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            spans.setdefault(".".join(parts[:i]), set()).add(k)
    plans: list[list[str]] = []
    for k, block in enumerate(names):
        group: list[str] = []
        for n in block:
            owner = n.rsplit(".", 1)[0]
            if spans[owner] != {k}:
                other = min(spans[owner] - {k})
                raise UsbyteError(f"{source}: blocks[{k}]: expected whole modules ({_MANUAL} "
                                  f"buckets by module): module {owner!r} has tensors in blocks[{k}] "
                                  f"and blocks[{other}]")
            parts = owner.split(".")
            top = next(".".join(parts[:i]) for i in range(1, len(parts) + 1)
                       if spans[".".join(parts[:i])] == {k})
            if top not in group:
                group.append(top)
        plans.append(group)
    return plans


# --------------------------------------------------------------------------------------------
# (c) DDP's reducer
# --------------------------------------------------------------------------------------------


def ddp_bucket_cap_mb_list(schedule: Schedule | str | os.PathLike[str], profile: Profile | None = None,
                           source: str | None = None) -> list[float]:
    """The ``bucket_cap_mb_list`` of ``DistributedDataParallel``: the existing conversion,
    :func:`usbyte_opt.planning.ddp.bucket_caps_mb` (what :func:`usbyte_opt.ddp.planned_ddp_kwargs`
    gives; bucket ``i`` of ``S`` bytes gets ``S - 1`` bytes, as DDP closes a bucket once it
    *reaches* its cap).

    **Can express:** per-bucket sizes in gradient-ready order, for DDP's C++ reducer, eager or
    under ``torch.compile`` with the default ``optimize_ddp`` (DDPOptimizer splits the graph at
    one uniform cap, ``max(bucket_cap_mb_list)``, but the reducer's buckets are the plan's).
    Fence mode, one buffer, whole tensors, blocks in the buffer's order (the ``ddp-tuned``
    strategy's schedules).

    **Cannot express:** anything else, refused in one line naming the field (``mode``,
    ``buffers``, ``blocks[k]``, ``shapes``); and compiled autograd with the python reducer:
    torch 2.13's DDP refuses ``bucket_cap_mb_list`` when
    ``torch._dynamo.config.optimize_ddp == "python_reducer"`` (an ``AssertionError`` at
    construction), so this raises a ``UsbyteError`` then instead; there, use
    :func:`inductor_all_reduce_buckets`.

    Raises:
        UsbyteError: as above.
    """
    schedule, source = _load(schedule, source)
    if schedule.shapes is None and profile is not None:
        import dataclasses

        schedule = dataclasses.replace(schedule, shapes={t.name: tuple(t.shape) for t in profile.tensors})
    for k, blk in enumerate(schedule.blocks):
        if blk.hier:
            raise UsbyteError(f"{source}: blocks[{k}].hier: expected false: DDP all-reduces its "
                              "buckets on the whole group")
    dynamo_config = sys.modules.get("torch._dynamo.config")   # set only by code that imported it
    if getattr(dynamo_config, "optimize_ddp", None) == "python_reducer":
        raise UsbyteError(f"{source}: runner: DDP's python reducer (torch._dynamo.config."
                          "optimize_ddp = \"python_reducer\") takes no bucket_cap_mb_list; give "
                          "the plan to inductor with usbyte_opt.compiled_buckets."
                          "inductor_all_reduce_buckets(schedule) instead")
    return bucket_caps_mb(schedule, source)


__all__ = ["BEYOND_PLAN_MB", "BucketSizeDeterminator", "ddp_bucket_cap_mb_list", "inductor_all_reduce_buckets",
           "inductor_bucket_bytes", "inductor_bucket_size_determinator", "module_bucket_plans"]
