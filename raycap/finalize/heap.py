"""A roomier heap while batches are finalized: their buffers are reused, not faulted in again.

Finalizing a batch of long rollouts allocates and frees tens of megabytes over and over
(captures read whole, records dumped, shards encoded). With glibc's default padding the
heap grows by what each request needs and gives the rest back, so the same memory is
mapped and zero-filled again for the next batch: on a results file over 230 MB of
captures that was about 110,000 page faults, a fifth of a second of the kernel's time.
Growing the heap 64 MB at a time (`M_TOP_PAD`) halves them.

`roomy_heap` sets that padding while at least one finalize runner of this process is
running, and puts glibc's default (128 KiB, mallopt(3)) back once the last one stops, so
a long-lived caller keeps no extra memory afterwards. Elsewhere than glibc it does
nothing.

This module does not import Ray.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

M_TOP_PAD = -2  # mallopt(3)
DEFAULT_TOP_PAD = 128 * 1024
FINALIZE_TOP_PAD = 64 << 20

_lock = threading.Lock()
_holders = 0
_libc: Any = None


def _mallopt() -> Any:
    """glibc's mallopt, or None (another C library, or none found)."""
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None)  # the symbols this process has loaded: its C library's among them
            # glibc only: another C library's mallopt differs, or there is none.
            _libc = libc.mallopt if hasattr(libc, "gnu_get_libc_version") else False
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


class RoomyHeap:
    """Held by a runner from its start to its stop (see the module docstring)."""

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> "RoomyHeap":
        global _holders
        mallopt = _mallopt()
        if mallopt is None or self.held:
            return self
        with _lock:
            if _holders == 0:
                mallopt(M_TOP_PAD, FINALIZE_TOP_PAD)
            _holders += 1
            self.held = True
        return self

    def release(self) -> None:
        global _holders
        if not self.held:
            return
        with _lock:
            _holders -= 1
            self.held = False
            if _holders == 0:
                _mallopt()(M_TOP_PAD, DEFAULT_TOP_PAD)


def roomy_heap() -> RoomyHeap:
    """The padding held until the returned object's `release`."""
    return RoomyHeap().hold()


def padding_held() -> bool:
    """Whether some runner of this process holds the padding now."""
    return _holders > 0
