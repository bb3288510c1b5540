"""The small exception hierarchy of usbyte-opt.

Domain code raises these; the CLI turns each into one line on stderr and a non-zero exit
(a traceback only with ``--debug``). Anything else that escapes is a bug.
"""

from __future__ import annotations


class UsbyteError(Exception):
    """Base of every user-facing error: its ``str`` is the whole message, on one line."""

    exit_code = 1


class UsageError(UsbyteError):
    """A command line or an output path that cannot be used as given (exit code 2, as for a
    usage error of the command-line parser)."""

    exit_code = 2


class ExitError(UsbyteError):
    """An error whose exit code is another process's: a failed rank's, or 128 + the signal
    that stopped the run.

    Example::

        >>> ExitError("rank 1: no such dataset", 3).exit_code
        3
    """

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


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


class PeerFailure(DistributedError):
    """A collective failed on this rank because another rank stopped or timed out: not this
    rank's own failure. Its error file says so (:mod:`usbyte_opt.launcher`), so that the
    launcher names the rank that caused it; with ``silent`` (ranks that launcher started) the
    rank prints nothing itself."""

    def __init__(self, message: str, silent: bool = False):
        super().__init__(message)
        self.silent = silent


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first line of ``exc``'s message, for a one-line report; ``default`` (the exception's
    type name unless given) when the message is empty.

    Example::

        >>> first_line(RuntimeError("peer closed\\n  at gloo.cc:12"))
        'peer closed'
        >>> first_line(KeyError()), first_line(ValueError(""), "")
        ('KeyError', '')
    """
    text = str(exc).strip()
    if text:
        return text.splitlines()[0]
    return type(exc).__name__ if default is None else default


def with_rank(rank: int | str, message: str) -> str:
    """``message`` said by rank ``rank``: ``rank N: message``, unless it already begins so
    (errors raised by collectives name their rank themselves). The one place a message gets
    its rank prefix.

    Example::

        >>> with_rank(1, "no such dataset")
        'rank 1: no such dataset'
        >>> with_rank(0, "rank 0: start-up check failed")
        'rank 0: start-up check failed'
    """
    prefix = f"rank {rank}:"
    return message if message.startswith(prefix) else f"{prefix} {message}"


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1.

    Example::

        >>> plural(1, "block"), plural(3, "block"), plural(2, "all-reduce"), plural(0, "rank")
        ('1 block', '3 blocks', '2 all-reduces', '0 ranks')
    """
    return f"{n} {noun if n == 1 else (many or noun + 's')}"


__all__ = ["DistributedError", "ExitError", "FormatError", "MismatchError", "PeerFailure",
           "UsageError", "UsbyteError", "first_line", "plural", "with_rank"]
