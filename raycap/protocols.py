"""What a token capture looks like to its consumers and producers.

A `TokenSource` hands out frozen snapshots of a rollout's capture: after `freeze`
returns, no write to that rollout may succeed, and freezing again returns the same
snapshot. `drop` retires exactly the snapshot that was consumed and returns False if
anything changed since, so a late write is never thrown away unseen.

A `TokenSink` is the writer side used by model servers. Entry order means nothing: the
builders order calls by their token content, not by arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from raycap.records import TokenEntry


@dataclass(frozen=True)
class TokenCaptureSnapshot:
    """The frozen capture of one rollout."""

    rollout_id: str
    entries: tuple[TokenEntry, ...]
    incomplete: bool
    snapshot_id: str
    version: int


@runtime_checkable
class TokenSource(Protocol):
    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot: ...

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...

    async def close(self) -> None: ...


@runtime_checkable
class TokenSink(Protocol):
    async def put(self, entry: TokenEntry) -> None: ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...

    async def close(self) -> None: ...
