"""One actor per capture directory: the only process that takes the directory's locks
on behalf of raycap, pinned to the node that holds it.

The actor keeps no state of its own: everything lives in the capture files, so a
restarted actor (after a crash or `ray.kill`) serves exactly what the old one did.
Calls are safe to run twice: freezing is idempotent (the same snapshot comes back) and a
repeated drop of the same snapshot is harmless, which is what lets Ray retry them.

File work blocks, so it runs on a small thread pool: one slow fsync does not serialise
the directory, and the actor holds no CPU slot that builder tasks need. `freeze_batch`
returns raw JSONL bytes, not parsed records: parsing and validation run in the builder
tasks, in parallel, wherever Ray places them (preferably next to the bytes).
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from raycap.protocols import TokenCaptureSnapshot
from raycap.store import FrozenCapture, TokenCaptureStore

IO_THREADS = 8


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class CaptureDirectory:
    """A TokenSource over one capture directory, plus batch calls (runs as a Ray actor)."""

    def __init__(self, path: str):
        self.path = path
        self.store = TokenCaptureStore(path, create=False)
        self._pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="raycap-io")

    async def _io(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        import os

        return os.getpid()

    # TokenSource -----------------------------------------------------------------------
    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        return await self._io(self.store.freeze, rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await self._io(self.store.drop, rollout_id, snapshot_id=snapshot_id, version=version)

    async def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="raycap-io")

    # Batch calls -----------------------------------------------------------------------
    async def rollout_ids(self) -> list[str]:
        return await self._io(self.store.rollout_ids)

    async def freeze_batch(self, rollout_ids: list[str]) -> list[FrozenCapture | str]:
        """Freeze each rollout; a failure is returned as "<Type>: <message>" in its slot."""

        def one(rollout_id: str) -> FrozenCapture | str:
            try:
                return self.store.freeze_raw(rollout_id)
            except Exception as exc:  # noqa: BLE001 - reported per rollout, never for the batch
                return _error_text(exc)

        return list(await asyncio.gather(*(self._io(one, rid) for rid in rollout_ids)))

    async def drop_batch(self, snapshots: list[tuple[str, str, int]]) -> list[bool | str]:
        """Drop (rollout_id, snapshot_id, version) triples; True, False or an error text."""

        def one(item: tuple[str, str, int]) -> bool | str:
            rollout_id, snapshot_id, version = item
            try:
                return self.store.drop(rollout_id, snapshot_id=snapshot_id, version=version)
            except Exception as exc:  # noqa: BLE001
                return _error_text(exc)

        return list(await asyncio.gather(*(self._io(one, item) for item in snapshots)))

    async def delete_batch(self, rollout_ids: list[str]) -> list[str | None]:
        """Delete each rollout's capture (administrative clear); None or an error text."""

        def one(rollout_id: str) -> str | None:
            try:
                self.store.delete(rollout_id)
                return None
            except Exception as exc:  # noqa: BLE001
                return _error_text(exc)

        return list(await asyncio.gather(*(self._io(one, rid) for rid in rollout_ids)))

    async def sweep_retired(self, older_than_seconds: float) -> int:
        return await self._io(self.store.sweep_retired, older_than_seconds)


def actor_name(node_id: str, path: str) -> str:
    digest = hashlib.sha1(f"{node_id}:{path}".encode()).hexdigest()[:16]
    return f"raycap-dir-{digest}"


CaptureDirectoryActor = ray.remote(CaptureDirectory)


class ActorTokenSource:
    """The async TokenSource protocol over a capture-directory actor handle."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        return await self.handle.freeze.remote(rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await self.handle.drop.remote(rollout_id, snapshot_id=snapshot_id, version=version)

    async def close(self) -> None:
        await self.handle.close.remote()
