"""What a token capture looks like to its consumers and producers.

A `TokenSource` hands out frozen snapshots of a rollout's capture: after `freeze`
returns, no write to that rollout may succeed, and freezing again returns the same
snapshot. `drop` retires exactly the snapshot that was consumed and returns False if
anything changed since, so a late write is never thrown away unseen.

A `TokenSink` is the writer side used by model servers. Entry order means nothing: the
builders order calls by their token content, not by arrival.

A process may install one default sink and one default source (`install_token_sink`,
`install_token_source`), as NeMo Gym's model servers and consumers look them up: whoever
owns the process installs its transport once, and capture code that is not handed an
explicit sink or source uses the installed one. Installing None clears it. The installer
keeps ownership: nothing here closes an installed object.

This module imports neither Ray nor any server stack, so an inference worker can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from raycap.capture.records import TokenEntry


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


# One process-wide default each, set by whoever owns the process.
_INSTALLED_SINK: TokenSink | None = None
_INSTALLED_SOURCE: TokenSource | None = None


def install_token_sink(sink: TokenSink | None) -> None:
    """Set (or, with None, clear) this process's default TokenSink."""
    global _INSTALLED_SINK
    _INSTALLED_SINK = sink


def installed_token_sink() -> TokenSink | None:
    return _INSTALLED_SINK


def install_token_source(source: TokenSource | None) -> None:
    """Set (or, with None, clear) this process's default TokenSource."""
    global _INSTALLED_SOURCE
    _INSTALLED_SOURCE = source


def installed_token_source() -> TokenSource | None:
    return _INSTALLED_SOURCE
