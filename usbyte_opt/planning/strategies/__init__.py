"""Strategy registry: every strategy is ``plan(problem, **options) -> Plan``.

A strategy module registers itself with :func:`register`; :data:`STRATEGIES` maps names to
:class:`Strategy` entries in the order they are reported. A strategy that has no plan for a
profile raises :class:`NotApplicable`. All strategies emit blocks in the
same language, and every candidate they weigh is scored by the one scorer
(:class:`usbyte_opt.planning.fastsim.Scorer`, the closed form of the iteration model that
:mod:`usbyte_opt.planning.simulate` walks), except where a strategy's own algorithm times its
blocks as it builds them (US-Byte's phases, the DDP-tuned programme: their docstrings say how
that relates to the scorer).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import UsbyteError
from ...formats import Block, Mode
from ..problem import Layout, Runner


class NotApplicable(UsbyteError):
    """The profile has no plan of this strategy (e.g. ``ddp-tuned`` on several dtypes); the
    planner leaves the strategy out and names it with this message."""


@dataclass(slots=True)
class Plan:
    """What a strategy returns: a layout, blocks in issue order, and notes for the report."""

    layout: Layout
    blocks: list[Block]
    mode: Mode
    """The mode the schedule runs in: fence (every block, then every update, as DDP) or
    overlap (each update gated in the next forward); each strategy's own (docs/design.md
    §3.1), or for ``best`` whichever is faster."""
    info: dict[str, Any] = field(default_factory=dict)
    """Tuned knobs and anything worth reporting (e.g. ``{"partition": 4_000_000}``)."""
    gathers: list[tuple[int, ...]] | None = None
    """Sharded mode: the all-gathers in issue order, each the indices of the blocks it
    gathers (:attr:`usbyte_opt.formats.Schedule.gathers`)."""
    runner: Runner = Runner.RUNTIME
    """What runs the schedule, and so what host cost the scorer charges it: the runtime, or
    torch DDP (the ``ddp`` and ``ddp-tuned`` strategies)."""
    cut_pieces: tuple[int, ...] | None = None
    """A compiled profile: the pieces a strategy that weighed the cuts chose to cut before
    (``best``: :func:`usbyte_opt.planning.compiled.choose_cuts`); ``None``: the planner
    chooses them when it scores the plan."""

    def __post_init__(self) -> None:
        self.mode = Mode(self.mode)
        self.runner = Runner(self.runner)


PlanFn = Callable[..., Plan]


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    plan: PlanFn


STRATEGIES: dict[str, Strategy] = {}
#: The strategies of sharded mode (``optimize --shard``): plans of reduce-scatter blocks and
#: all-gather groups, scored by :mod:`usbyte_opt.planning.sharded`.
SHARDED_STRATEGIES: dict[str, Strategy] = {}

#: The built-in strategies, in report order; each is registered by the module of its name
#: (``-`` read as ``_``).
_BUILTIN = ("wfbp", "ddp", "ddp-tuned", "mgwfbp", "bytescheduler", "usbyte", "best")
#: The built-in sharded strategies, in report order (modules named alike).
_BUILTIN_SHARDED = ("fsdp-like", "dear-like", "best-sharded")


def register(name: str, sharded: bool = False) -> Callable[[PlanFn], PlanFn]:
    """Decorator: ``@register("wfbp")`` enters the plan function under ``name``;
    ``sharded=True`` enters a sharded-mode strategy (:data:`SHARDED_STRATEGIES`)."""

    def deco(fn: PlanFn) -> PlanFn:
        (SHARDED_STRATEGIES if sharded else STRATEGIES)[name] = Strategy(name, fn)
        return fn

    return deco


def get(name: str) -> Strategy:
    load_builtin()
    if name not in STRATEGIES:
        raise UsbyteError(f"strategy {name!r}: expected one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def load_builtin() -> dict[str, Strategy]:
    """Import the built-in strategies; returns the registry in report order (built-ins first,
    in :data:`_BUILTIN` order, whatever order the modules were imported in)."""
    return _load(_BUILTIN, STRATEGIES)


def load_sharded() -> dict[str, Strategy]:
    """Import the built-in sharded strategies; returns :data:`SHARDED_STRATEGIES` in report
    order (as :func:`load_builtin`)."""
    return _load(_BUILTIN_SHARDED, SHARDED_STRATEGIES)


def _load(builtin: tuple[str, ...], registry: dict[str, Strategy]) -> dict[str, Strategy]:
    for name in builtin:
        importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
    ordered = {n: registry[n] for n in builtin}
    ordered.update((n, s) for n, s in registry.items() if n not in ordered)
    registry.clear()
    registry.update(ordered)
    return registry
