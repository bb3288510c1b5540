"""The torch-free planning core: cost model, problem, the iteration model, bounds, exact
search, strategies and the planner that compares them.

One iteration model (docs/planner.md): :mod:`.simulate` walks it step by step (the definition,
with :mod:`.sharded` for sharded mode, on :mod:`.timeline`'s types); :mod:`.fastsim` and
:func:`.sharded.sharded_time` are its closed forms, the same numbers, what every plan is scored
with; :mod:`.bounds` proves a floor under it. DDP's bucket plans are :mod:`.ddp`.

Nothing in this package imports torch (``tests/test_planning_core.py`` checks it in a fresh
interpreter), so ``usbyte-opt optimize`` starts fast and plans on a machine without torch. It
depends only on :mod:`usbyte_opt.formats` and :mod:`usbyte_opt.errors`.
"""
