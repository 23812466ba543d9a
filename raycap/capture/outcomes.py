"""What one rollout's freeze or drop in one directory came to, as small typed values.

A batch call answers every rollout in its own slot, so one bad rollout never fails its
batch. A freeze slot holds a `FrozenCapture`, a `FreezeFailed` (its masked row's error
text, "<Type>: <message>"), or None where the directory does not hold the rollout. A
drop answers a `DropOutcome`: dropped, kept because the capture changed since its
build, or failed with a reason. This module does not import Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from raycap.capture.store import FrozenCapture


@dataclass(frozen=True)
class FreezeFailed:
    """A rollout that could not be frozen or read in one directory."""

    error: str


# One directory's answer for one rollout of a batch.
Part = FrozenCapture | FreezeFailed | None


def as_part(frozen: FrozenCapture | str) -> FrozenCapture | FreezeFailed:
    """A store's freeze result as a part: the store reports a failure as its text."""
    return FreezeFailed(frozen) if isinstance(frozen, str) else frozen


@dataclass(frozen=True)
class DropOutcome:
    """Dropping one snapshot: `dropped`, or kept because it `changed` since it was
    built, or failed with `error` (nothing known to be dropped; retiring again is safe)."""

    dropped: bool = False
    error: str = ""

    @property
    def changed(self) -> bool:
        return not self.dropped and not self.error

    @classmethod
    def of(cls, dropped: bool) -> DropOutcome:
        """The outcome of a store's drop: True dropped, False changed since the build."""
        if not isinstance(dropped, bool):
            # A coroutine here means the async protocol method was called where the
            # synchronous one was meant: nothing was dropped, and truthiness would lie.
            raise TypeError(f"a drop outcome is a bool, not {type(dropped).__name__}; call the store's drop_now")
        return cls(dropped=dropped)

    @classmethod
    def failed(cls, error: str) -> DropOutcome:
        return cls(error=error)
