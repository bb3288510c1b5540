"""The two file formats of usbyte-opt: profiles and schedules (docs/design.md §4).

Both are versioned JSON, validated on load (errors name the file, the field path and what was
expected) and written atomically (temporary file in the same folder, then ``os.replace``), so a
reader never sees half a file. Three parts:

* :mod:`~usbyte_opt.formats.data`: the in-memory types (frozen dataclasses), digests,
  fingerprints and the checks of a schedule against a profile;
* :mod:`~usbyte_opt.formats.schema`: what a file may hold, defined once (pydantic), from which
  come both the validation and the JSON Schema of ``usbyte-opt schema``, and the physical
  bounds;
* :mod:`~usbyte_opt.formats.files`: reading and writing files.

This package imports no torch: the planner and the CLI's ``optimize`` stay fast.

Example::

    >>> p = Profile(name="toy", forward_ms=2.0, backward_ms=4.0,
    ...             tensors=(TensorSpec("w", (4, 4), "float32", ready_ms=1.0, need_ms=0.0),),
    ...             comm=CommSpec(backend="analytic", world_size=2, alpha_ms=0.1, algbw_gbs=1.0))
    >>> Profile.from_dict(p.to_dict(), "mem").tensors[0].nbytes
    64
"""

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
                   Mode,
                   Profile,
                   Schedule,
                   TensorSpec,
                   check_against,
                   check_coverage,
                   fingerprint,
)
from .files import load_profile, load_schedule, read_json, save_profile, save_schedule, write_json
from .schema import (
                   MAX_ALGBW_GBS,
                   MAX_ELEMENTS,
                   MAX_GRADIENT_BYTES,
                   MAX_MS,
                   MAX_WORLD_SIZE,
                   MIN_ALGBW_GBS,
                   parse_profile,
                   parse_schedule,
                   profile_schema,
                   schedule_schema,
)

__all__ = [
    "COMM_BACKENDS", "DTYPE_SIZES", "MAX_ALGBW_GBS", "MAX_ELEMENTS", "MAX_GRADIENT_BYTES",
    "MAX_MS", "MAX_WORLD_SIZE", "MIN_ALGBW_GBS", "PROFILE_FORMAT", "SCHEDULE_FORMAT",
    "SCHEDULE_MODES", "VERSION", "Block", "Buffer", "CommSpec", "Mode", "Profile", "Schedule",
    "TensorSpec", "check_against", "check_coverage", "fingerprint", "load_profile",
    "load_schedule", "parse_profile", "parse_schedule", "profile_schema", "read_json",
    "save_profile", "save_schedule", "schedule_schema", "write_json",
]
