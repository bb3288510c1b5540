"""The two file formats of usbyte-opt: profiles and schedules (docs/design.md §4).

Both are versioned JSON, validated on load (errors name the file, the field path and what was
expected) and written atomically (temporary file in the same folder, then ``os.replace``), so a
reader never sees half a file. Three parts:

* :mod:`~usbyte_opt.formats.data`: the in-memory types (frozen dataclasses), digests,
  fingerprints and the checks of a schedule against a profile;
* :mod:`~usbyte_opt.formats.schema`: files and objects, both ways, defined once: what a file
  may hold, from which come the validation of a file read (pydantic), the check of an object
  written and the JSON Schema of ``usbyte-opt schema``; the conversions
  (:func:`parse_profile`, :func:`dump_profile`, ...) and the physical bounds;
* :mod:`~usbyte_opt.formats.files`: reading and writing files.

This package imports no torch, so the planner and the CLI's ``optimize`` stay fast, and no
pydantic until a file is read or a schema printed.

Example::

    >>> p = Profile(name="toy", forward_ms=2.0, backward_ms=4.0,
    ...             tensors=(TensorSpec("w", (4, 4), "float32", ready_ms=1.0, need_ms=0.0),),
    ...             comm=CommSpec(backend="analytic", world_size=2, alpha_ms=0.1, algbw_gbs=1.0))
    >>> parse_profile(dump_profile(p), "mem").tensors[0].nbytes
    64
"""

from .data import (
                   COMM_BACKENDS,
                   DEFAULT_HOST_US,
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
                   check_against,
                   check_coverage,
                   check_runner,
                   ddp_buckets,
                   fingerprint,
)
from .files import load_profile, load_schedule, read_json, save_profile, save_schedule, write_json
from .schema import (
                   MAX_ALGBW_GBS,
                   MAX_ELEMENTS,
                   MAX_GRADIENT_BYTES,
                   MAX_HOST_US,
                   MAX_MS,
                   MAX_WORLD_SIZE,
                   MIN_ALGBW_GBS,
                   dump_profile,
                   dump_schedule,
                   parse_profile,
                   parse_schedule,
                   profile_schema,
                   schedule_schema,
)

__all__ = [
    "COMM_BACKENDS", "DEFAULT_HOST_US", "DTYPE_SIZES", "MAX_ALGBW_GBS", "MAX_ELEMENTS", "MAX_GRADIENT_BYTES",
    "MAX_HOST_US", "MAX_MS", "MAX_WORLD_SIZE", "MIN_ALGBW_GBS", "PROFILE_FORMAT", "SCHEDULE_FORMAT",
    "SCHEDULE_MODES", "SCHEDULE_RUNNERS", "VERSION", "Block", "Buffer", "CollectiveCost", "CommSpec",
    "HostCost", "Mode", "Profile", "Runner", "Schedule", "TensorSpec", "check_against", "check_coverage",
    "check_runner", "ddp_buckets", "dump_profile", "dump_schedule",
    "fingerprint", "load_profile", "load_schedule", "parse_profile", "parse_schedule",
    "profile_schema", "read_json", "save_profile", "save_schedule", "schedule_schema",
    "write_json",
]
