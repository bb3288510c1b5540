"""Reading and writing profile and schedule files.

A file that is missing, unreadable, not UTF-8 or not JSON is a :class:`FormatError` naming it;
what it holds is then validated by :mod:`usbyte_opt.formats.schema`, which also checks and
converts what is written (without pydantic: saving needs none). Writes are atomic: a
temporary file in the same folder, fsync, then ``os.replace``, so a reader never sees half a
file and a failed write leaves the old one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import FormatError
from .data import Profile, Schedule
from .schema import dump_profile, dump_schedule, parse_profile, parse_schedule


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a missing, unreadable or malformed file is a :class:`FormatError`.

    Example::

        >>> read_json("/nonexistent/p.json")
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.FormatError: /nonexistent/p.json: expected an existing file
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(str(path), "", "an existing file") from None
    except UnicodeDecodeError as e:
        raise FormatError(str(path), "", f"a UTF-8 text file (byte {e.start} is not)") from None
    except OSError as e:
        raise FormatError(str(path), "", f"a readable file ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(str(path), f"line {e.lineno} column {e.colno}", f"valid JSON ({e.msg})") from None
    except RecursionError:
        raise FormatError(str(path), "", "valid JSON nested less deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise FormatError(str(path), "", f"valid JSON ({e})") from None


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write JSON atomically: a temporary file in the same folder, fsync, then rename."""
    path = Path(path)
    # one string, one write: json.dump would write each of the encoder's chunks (some 100,000
    # for a schedule of 10,000 blocks) on its own
    text = json.dumps(data, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a written file gets the usual mode
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile file."""
    return parse_profile(read_json(path), str(path))


def save_profile(profile: Profile, path: str | os.PathLike) -> Path:
    """Check ``profile`` as a reader would (a value out of bounds is a
    :class:`~usbyte_opt.errors.FormatError` naming ``path`` and the field, and nothing is
    written), then write it atomically; returns the path."""
    return write_json(path, dump_profile(profile, str(path)))


def load_schedule(path: str | os.PathLike) -> Schedule:
    """Read and validate a schedule file."""
    return dataclasses.replace(parse_schedule(read_json(path), str(path)), path=str(path))


def save_schedule(schedule: Schedule, path: str | os.PathLike) -> Path:
    """Check ``schedule`` as a reader would, then write it atomically (as
    :func:`save_profile`); returns the path."""
    return write_json(path, dump_schedule(schedule, str(path)))
