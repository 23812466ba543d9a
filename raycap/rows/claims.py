"""Claims: which of two processes on one node builds a batch they were both given.

A training step's ids are built by the calling process and builder tasks at once
(`raycap.cluster.rebuild.scheduler`). Each task's batch has a claim: an empty token file
the calling process makes before it submits the task. Whoever removes the token builds
the batch. The task claims it when it starts; the calling process, once its own share is
built, claims the batches whose tasks have not started yet, and builds them itself
instead of waiting for a worker that has no core (Ray starts its workers niced, and
they start only when a CPU of the cluster is free).

- An unlink succeeds for one process only, so a batch is built once. A task that lost
  the claim returns no rows, at once.
- A claim says who builds a batch and nothing more. Freezing stays idempotent, and a
  batch is built the same rows wherever it is built.
- A call's tokens are removed when the call ends, so a task that starts later claims
  nothing. They live in a directory of the process's own, on memory-backed /dev/shm
  where there is one (making one costs no disk inode: see `raycap.capture.spares`),
  removed when the process exits.

This module does not import Ray.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

_SHM = "/dev/shm"
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

_directory: str | None = None
_owner = 0
_lock = threading.Lock()


@dataclass(frozen=True)
class Claim:
    """The claim of one batch: its token's path. Sent to the builder task as it is."""

    token: str

    def take(self) -> bool:
        """Claim the batch: True for the one process whose unlink removed the token. False
        when it was taken already, dropped, or is not visible here (another node)."""
        try:
            os.unlink(self.token)
        except OSError:
            return False
        return True

    def drop(self) -> None:
        """Remove the token if nobody took it: from now on nobody can."""
        self.take()


def new_claim() -> Claim | None:
    """A claim for a batch, its token made; None when none can be made here (the caller
    then does not share the batch)."""
    directory = _claims_directory()
    if directory is None:
        return None
    token = os.path.join(directory, os.urandom(8).hex())
    try:
        os.close(os.open(token, _CREATE, 0o600))
    except OSError:
        return None
    return Claim(token)


def _claims_directory() -> str | None:
    """This process's directory of tokens, made on first use (and again in a forked
    child: the directory is removed by the process that made it, at its exit)."""
    global _directory, _owner
    with _lock:
        if _directory is None or _owner != os.getpid():
            where = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK) else None
            try:
                _directory = tempfile.mkdtemp(prefix="raycap-claims-", dir=where)
            except OSError:
                return None
            _owner = os.getpid()
            atexit.register(_remove, _directory, _owner)
        return _directory


def _remove(directory: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)
