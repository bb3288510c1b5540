"""Stock PyTorch DDP with planned buckets: no custom runtime, everything DDP supports.

PyTorch's ``DistributedDataParallel(..., bucket_cap_mb_list=[...])`` takes one size limit per
bucket. DDP rebuilds its buckets after the first iteration, in the order gradients became
ready, closing bucket ``i`` once it holds at least ``bucket_cap_mb_list[i]``; it all-reduces
the buckets in that order, and steps the optimizer after all of them (fence mode,
docs/design.md §2.6). So a schedule whose blocks are whole tensors, contiguous in gradient-ready
order, in one buffer, and in fence mode (the ``ddp-tuned`` strategy plans exactly those) is a
list of bucket sizes: :func:`bucket_caps_mb` computes it (torch-free, in
:mod:`usbyte_opt.planning.ddp` with every other DDP bucket plan; importable from here too),
:func:`planned_ddp_kwargs` gives the keyword arguments for any place that builds DDP,
:func:`wrap` builds the DDP model, and :func:`check_buckets` / :func:`watch_buckets` compare
what DDP actually built with the plan.

Example (the caps of a schedule, no process group needed)::

    >>> import dataclasses, torch
    >>> from usbyte_opt.runtime import default_schedule
    >>> m = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(3)])
    >>> s = dataclasses.replace(default_schedule(m), mode="fence")
    >>> [int(c * 2**20) for c in bucket_caps_mb(s)]   # bytes: just under 1 MiB, then 2 MiB
    [1048575, 2097151]
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from .errors import MismatchError, UsbyteError
from .formats import DTYPE_SIZES, Schedule
from .planning.ddp import MIB as _MB
from .planning.ddp import bucket_caps_mb, planned_buckets

if TYPE_CHECKING:  # torch only where DDP is built: planning a schedule's caps needs none
    import torch


def supports_bucket_list() -> bool:
    """Whether this torch's DDP takes ``bucket_cap_mb_list``."""
    from torch.nn.parallel import DistributedDataParallel

    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


def expressible(schedule: Schedule) -> str:
    """Why stock DDP cannot run ``schedule`` ('' if it can): fence mode, whole tensors in
    gradient-ready order, one dtype (what the ``ddp-tuned`` strategy plans), and a torch whose
    DDP takes ``bucket_cap_mb_list``. The trainer integrations run stock DDP exactly when this
    is empty, and the runtime otherwise."""
    try:
        planned_buckets(schedule)
    except UsbyteError as e:
        return str(e).split(": ", 1)[-1]
    if not supports_bucket_list():
        import torch

        return f"torch {torch.__version__}: DistributedDataParallel has no bucket_cap_mb_list"
    return ""


def planned_ddp_kwargs(schedule: Schedule | str, model: torch.nn.Module | None = None, *,
                       find_unused_parameters: bool = False, static_graph: bool = False,
                       source: str | None = None) -> dict[str, Any]:
    """The keyword arguments that make ``DistributedDataParallel(model, **kwargs)`` run the
    schedule's blocks as its buckets, for any place that builds DDP (a trainer's strategy, a
    launcher's wrapper)::

        DistributedDataParallel(model, device_ids=[i], **planned_ddp_kwargs(schedule))

    DDP rebuilds its buckets in gradient-ready order in the second iteration, and the caps
    then give the planned buckets. With ``find_unused_parameters=True`` (and no
    ``static_graph``) DDP never rebuilds: it keeps its first buckets, which follow the
    model's registration order reversed, so the caps are given in that order, which is
    right only when the schedule's gradient-ready order is exactly the reverse registration
    order of ``model``'s trainable tensors; otherwise this refuses, saying so.

    Args:
        schedule: a ``ddp-tuned`` schedule (or its path).
        model: the module DDP will wrap; needed with ``find_unused_parameters=True``.
        find_unused_parameters, static_graph: as DDP's; passed on when true.
        source: the schedule's name in errors (default: its path, or ``<schedule>``).

    Raises:
        UsbyteError: DDP cannot express the schedule, this torch has no
            ``bucket_cap_mb_list``, or the combination cannot give the planned buckets.

    Example::

        >>> import dataclasses, torch
        >>> from usbyte_opt.runtime import default_schedule
        >>> m = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(3)])
        >>> s = dataclasses.replace(default_schedule(m), mode="fence")
        >>> kw = planned_ddp_kwargs(s)
        >>> sorted(kw), len(kw["bucket_cap_mb_list"])
        (['bucket_cap_mb_list'], 2)
        >>> planned_ddp_kwargs(s, m, find_unused_parameters=True)["bucket_cap_mb_list"] == (
        ...     kw["bucket_cap_mb_list"][::-1])   # caps in registration order
        True
    """
    from .formats import load_schedule

    if not isinstance(schedule, Schedule):
        source = source or str(schedule)
        schedule = load_schedule(schedule)
    source = source or "<schedule>"
    if not supports_bucket_list():
        import torch

        raise UsbyteError(f"torch {torch.__version__}: DistributedDataParallel has no "
                          "bucket_cap_mb_list (PyTorch 2.11 or newer has it); use the "
                          "usbyte-opt runtime (usbyte_opt.runtime.DistributedOptimizer) instead")
    caps = bucket_caps_mb(schedule, source)
    kwargs: dict[str, Any] = {"bucket_cap_mb_list": caps}
    if find_unused_parameters and not static_graph:
        why = ("find_unused_parameters=True: DDP then never rebuilds its buckets and keeps its "
               "first ones, in the model's registration order reversed")
        if model is None:
            raise UsbyteError(f"{why}; pass the model so that the caps follow that order, or "
                              "find_unused_parameters=False (every rank uses every parameter "
                              "every step), or static_graph=True (the unused set never changes)")
        from .runtime.default_plan import trainable_parameters

        reverse = [n for n, _ in trainable_parameters(model)][::-1]
        ready = [n for names in planned_buckets(schedule, source) for n in names]
        if ready != reverse:
            i = next((i for i, (a, b) in enumerate(zip(ready, reverse)) if a != b),
                     min(len(ready), len(reverse)))
            got = reverse[i] if i < len(reverse) else "nothing"
            raise UsbyteError(f"{why}, and the schedule's gradient-ready order is not that order "
                              f"(position {i}: planned {ready[i] if i < len(ready) else 'nothing'!r}"
                              f", registration reversed {got!r}); pass find_unused_parameters="
                              "False if every rank uses every parameter every step, or "
                              "static_graph=True if the unused set never changes")
        kwargs["bucket_cap_mb_list"] = caps[::-1]
    if find_unused_parameters:
        kwargs["find_unused_parameters"] = True
    if static_graph:
        kwargs["static_graph"] = True
    return kwargs


def wrap(model: torch.nn.Module, schedule: Schedule | str, *, check: bool = True,
         **ddp_kwargs: Any) -> Any:
    """``DistributedDataParallel(model, **planned_ddp_kwargs(schedule, model), **ddp_kwargs)``:
    stock DDP whose buckets are the schedule's blocks (from the second iteration on, as DDP
    rebuilds them in the first's gradient-ready order; from the first with
    ``find_unused_parameters=True``, which :func:`planned_ddp_kwargs` handles).

    Args:
        model: the module (on its device), as for DDP.
        schedule: a fence-mode schedule of whole, contiguous tensors in one buffer (the
            ``ddp-tuned`` strategy's), or its path.
        check: once DDP has its final buckets, compare them with the plan, once, and warn
            (:class:`~usbyte_opt.runtime.UsbyteWarning`) if they differ (:func:`watch_buckets`).
        **ddp_kwargs: anything else DDP takes, except ``bucket_cap_mb``/``bucket_cap_mb_list``.

    Raises:
        UsbyteError: this torch has no ``bucket_cap_mb_list``; the schedule is one DDP cannot
            express (cut tensors, an order DDP will not keep, overlap mode, several dtypes);
            conflicting bucket arguments; ``find_unused_parameters=True`` with a
            gradient-ready order that is not the reverse registration order.
        MismatchError: the model's trainable tensors are not the schedule's.
    """
    from torch.nn.parallel import DistributedDataParallel

    from .formats import load_schedule
    from .runtime.checks import check_model, model_label, schedule_source
    from .runtime.default_plan import model_tensors

    source = schedule_source(schedule) if isinstance(schedule, Schedule) else "<schedule>"
    if not isinstance(schedule, Schedule):
        source = str(schedule)
        schedule = load_schedule(schedule)
    for key in ("bucket_cap_mb", "bucket_cap_mb_list"):
        if key in ddp_kwargs:
            raise UsbyteError(f"{key}: the schedule gives the buckets; do not pass {key} to wrap()")
    kwargs = planned_ddp_kwargs(schedule, model, source=source,
                                find_unused_parameters=bool(ddp_kwargs.pop("find_unused_parameters",
                                                                           False)),
                                static_graph=bool(ddp_kwargs.pop("static_graph", False)))
    check_model(schedule, model_tensors(model), source, model_label(model))
    ddp_model = DistributedDataParallel(model, **kwargs, **ddp_kwargs)
    if check:
        watch_buckets(ddp_model, schedule)
    else:
        compiled_as_default(ddp_model)   # (watch_buckets does it too)
    return ddp_model


def _current_buckets(ddp_model: Any) -> list[tuple[int, list[int]]]:
    """DDP's buckets now, in all-reduce order: (bytes, ids of their parameters)."""
    out = []
    for b in ddp_model.reducer._get_zeros_like_grad_buckets():
        buf = b.buffer()
        out.append((buf.numel() * buf.element_size(), [id(p) for p in b.parameters()]))
    return out


def _final(ddp_model: Any) -> bool:
    """Whether DDP's buckets are final: rebuilt, or never to be rebuilt."""
    if getattr(ddp_model, "_has_rebuilt_buckets", False):
        return True
    return bool(ddp_model.find_unused_parameters) and not bool(ddp_model.static_graph)


def _caps_given(ddp_model: Any) -> list[int] | None:
    """The per-bucket caps (bytes) DDP was built with, where this torch says (else None)."""
    config = getattr(ddp_model, "_bucket_config", None)
    caps = getattr(config, "per_bucket_bytes_caps", None)
    return None if caps is None else [int(c) for c in caps]


def rebuilt_bucket_sizes(ddp_model: Any) -> list[int]:
    """The sizes (bytes) of DDP's buckets, in all-reduce order, read from its reducer: the
    rebuilt ones from the second iteration's forward on."""
    return [size for size, _ in _current_buckets(ddp_model)]


def check_buckets(ddp_model: Any, schedule: Schedule) -> None:
    """Raise :class:`~usbyte_opt.errors.MismatchError` unless DDP's buckets have the
    schedule's sizes and tensors. DDP rebuilds them in the second iteration's forward, so
    call this after the second iteration (or any later point); with
    ``find_unused_parameters=True`` it never rebuilds, and the check holds from the start.
    """
    size = DTYPE_SIZES[schedule.buffers[0].dtype]
    want = [(b.end - b.start) * size for b in schedule.blocks]
    if not _final(ddp_model):
        raise MismatchError("DDP has not rebuilt its buckets yet (it does in the second "
                            "iteration's forward): call check_buckets after the second iteration")
    now = _current_buckets(ddp_model)
    got = [s for s, _ in now]
    from .runtime.default_plan import trainable_parameters

    names = {id(p): n for n, p in trainable_parameters(ddp_model.module)}
    if got == want:
        planned = planned_buckets(schedule)
        for k, ((_, ids), plan) in enumerate(zip(now, planned)):
            if sorted(names.get(i, "?") for i in ids) != sorted(plan):
                raise MismatchError(f"DDP's bucket {k} holds other tensors than the schedule's "
                                    f"block {k} (same size): gradients became ready in another "
                                    "order than the profile's")
        return
    caps = _caps_given(ddp_model)
    planned_caps = sorted(int(c * _MB) for c in bucket_caps_mb(schedule))
    if caps is not None and sorted(caps) != planned_caps:
        why = ("DDP was built without the schedule's bucket_cap_mb_list; build it with "
               "usbyte_opt.ddp.planned_ddp_kwargs(schedule)")
    elif ddp_model.find_unused_parameters and not ddp_model.static_graph:
        why = ("find_unused_parameters=True: DDP keeps its first buckets (registration order "
               "reversed); build it with usbyte_opt.ddp.planned_ddp_kwargs(schedule, model, "
               "find_unused_parameters=True)")
    else:
        why = "gradients became ready in another order than the profile's"
    raise MismatchError(f"DDP's buckets are {got} bytes, the schedule planned {want}: {why}")


def compiled_as_default(ddp_model: Any, bucket_cap_mb: float | None = None) -> None:
    """Have dynamo compile a model under ``ddp_model`` (planned buckets) exactly as under DDP
    with its default buckets (``bucket_cap_mb``, else DDP's 25 MiB).

    Dynamo splits a graph compiled inside a DDP forward at the DDP module's
    ``bucket_bytes_cap`` (its ``DDPOptimizer``, with a first piece of 1 MiB), so that each
    piece's backward hands its gradients over. A bucket list sets that attribute to its
    largest bucket, which (a) cuts the compiled graphs elsewhere than the user's own compiled
    DDP does, and under a backend that fuses (inductor) the training could then round apart
    from DDP's, and (b) below 1 MiB stops the first compiled forward with dynamo's
    ``AssertionError`` ("First bucket should be smaller/equal to other buckets"). Only the
    attribute changes: DDP's reducer took its planned buckets at construction.

    Example (no process group needed for the attribute)::

        >>> class Planned:                     # stands for a DDP module built with a list
        ...     bucket_bytes_cap = 40_000
        >>> d = Planned()
        >>> compiled_as_default(d); d.bucket_bytes_cap == 25 * 2**20
        True
    """
    from .planning.ddp import BUCKET_CAP_BYTES

    ddp_model.bucket_bytes_cap = (int(bucket_cap_mb * _MB) if bucket_cap_mb is not None
                                  else BUCKET_CAP_BYTES)


def watch_buckets(ddp_model: Any, schedule: Schedule, bucket_cap_mb: float | None = None) -> None:
    """Check DDP's buckets against the schedule once they are final (after the forward in
    which DDP rebuilds them), once, on every rank alike: a mismatch is a
    :class:`~usbyte_opt.runtime.UsbyteWarning` (training is still DDP's, only not as
    planned). Every place that builds DDP with a schedule's buckets calls it, so it also sets
    what a compiled model under that DDP is compiled as (:func:`compiled_as_default`, with
    the user's ``bucket_cap_mb``)."""
    import warnings
    import weakref

    from .runtime.checks import UsbyteWarning

    compiled_as_default(ddp_model, bucket_cap_mb)
    ref = weakref.ref(ddp_model)
    handle: list[Any] = []

    def after_forward(*_: Any) -> None:
        ddp = ref()
        import torch

        if ddp is None or not torch.is_grad_enabled() or not _final(ddp):
            return
        handle[0].remove()
        try:
            check_buckets(ddp, schedule)
        except MismatchError as e:
            warnings.warn(f"usbyte-opt: {e}", UsbyteWarning, stacklevel=2)

    handle.append(ddp_model.register_forward_hook(after_forward))


__all__ = ["bucket_caps_mb", "check_buckets", "compiled_as_default", "expressible", "planned_buckets",
           "planned_ddp_kwargs", "rebuilt_bucket_sizes", "supports_bucket_list", "watch_buckets", "wrap"]
