"""The torch-free planning core: cost model, problem, simulators, bounds, exact search,
strategies and the planner that compares them.

Nothing in this package imports torch (``tests/test_planning_core.py`` checks it in a fresh
interpreter), so ``usbyte-opt optimize`` starts fast and plans on a machine without torch. It
depends only on :mod:`usbyte_opt.formats` and :mod:`usbyte_opt.errors`.
"""
