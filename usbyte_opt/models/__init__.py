"""Models the profiler can run (moved from ``usbyte_opt/models.py``; split in the next commit)."""

from .registry import *  # noqa: F403
from .registry import Built, Factory, __all__  # noqa: F401
