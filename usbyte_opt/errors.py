"""The small exception hierarchy of usbyte-opt.

Domain code raises these; the CLI turns each into one line on stderr and a non-zero exit
(a traceback only with ``--debug``). Anything else that escapes is a bug.
"""

from __future__ import annotations


class UsbyteError(Exception):
    """Base of every user-facing error: its ``str`` is the whole message, on one line."""

    exit_code = 1


class FormatError(UsbyteError):
    """A profile or schedule file that does not follow its format.

    The message names the file, the field path (``tensors[3].ready_ms``) and what was expected.

    Example::

        >>> str(FormatError("p.json", "tensors[0].ready_ms", "a number in [0, 10]", -1))
        'p.json: tensors[0].ready_ms: expected a number in [0, 10], got -1'
    """

    exit_code = 2

    def __init__(self, source: str, field: str, expected: str, got: object = ...):
        self.source, self.field, self.expected, self.got = source, field, expected, got
        msg = f"{source}: {field}: expected {expected}" if field else f"{source}: expected {expected}"
        if got is not ...:
            try:
                shown = repr(got)
            except ValueError:  # an integer of more digits than Python converts to text
                shown = f"an integer of {got.bit_length()} bits" if isinstance(got, int) else "?"
            msg += f", got {shown if len(shown) <= 60 else shown[:57] + '...'}"
        super().__init__(msg)


class MismatchError(UsbyteError):
    """Two things that must agree do not: a schedule and its profile, a schedule and a model."""

    exit_code = 3


class DistributedError(UsbyteError):
    """Ranks disagree (different schedules, world sizes) or a collective timed out."""

    exit_code = 4
