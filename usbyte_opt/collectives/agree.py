"""How ranks agree before they work together, and waits that fail in one line.

:func:`agree` is the one start-up exchange of the runtime and the profiler: every rank's
outcome is all-gathered, so a failure on one rank is raised on every rank and nothing hangs.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from ..env import SCHEDULE_ENV
from ..errors import DistributedError, first_line

#: Bytes of one rank's start-up record (its digest and the first part of its error).
RECORD_BYTES = 512


def wait(work: dist.Work, what: str, rank: int, timeout: timedelta | None) -> None:
    """``work.wait()`` that turns a timeout or a lost peer into one-line :class:`DistributedError`."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: {what} failed: {first_line(e)} (a peer crashed, timed out "
                               "or issued different collectives)") from e


def agree(group: dist.ProcessGroup | None, digest: str | None, error: BaseException | None,
          device: torch.device, timeout: timedelta | None) -> None:
    """All-gather each rank's outcome of its start-up checks and raise on every rank alike.

    The one way ranks agree before they work together: the runtime passes its schedule
    digest, the profiler only whether building the model worked (``digest=None``). Call it
    before any other collective. A rank whose own checks failed passes its error here instead
    of raising at once, so the other ranks are not left waiting in a collective.

    Raises:
        The rank's own error (if it had one); else :class:`DistributedError` naming the first
        rank that failed, or the first rank whose digest differs from rank 0's.
    """
    rank, ws = dist.get_rank(group), dist.get_world_size(group)
    msg = "" if error is None else str(error)
    rec = json.dumps({"d": digest or "", "e": msg[:RECORD_BYTES - 64]}).encode()[:RECORD_BYTES]
    mine = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    mine[: len(rec)] = torch.frombuffer(bytearray(rec), dtype=torch.uint8)
    mine = mine.to(device)
    out = [torch.empty_like(mine) for _ in range(ws)]
    what = "schedule digests" if digest is not None else "start-up errors"
    wait(dist.all_gather(out, mine, group=group, async_op=True),
         f"start-up check (all-gather of {what})", rank, timeout)
    recs = []
    for t in out:
        raw = bytes(t.cpu().tolist()).rstrip(b"\0")
        try:
            recs.append(json.loads(raw.decode()))
        except ValueError:
            recs.append({"d": "", "e": "unreadable start-up record"})
    if error is not None:
        raise error
    for r, rec_r in enumerate(recs):
        if rec_r["e"]:
            raise DistributedError(f"rank {rank}: rank {r} failed its start-up check: {rec_r['e']}")
    for r, rec_r in enumerate(recs):
        if rec_r["d"] != recs[0]["d"]:
            raise DistributedError(f"rank {rank}: the schedule differs across ranks: rank 0 has "
                                   f"digest {recs[0]['d']}, rank {r} has {rec_r['d']}; give every "
                                   f"rank the same file (${SCHEDULE_ENV} / usbyte-opt launch)")
