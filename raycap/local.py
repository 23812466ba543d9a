"""Rebuilding in this process: the local executor, and the choice of executor.

The local executor builds windows exactly as a builder task does (`raycap.batch`), in
this process, one core, so its rows are identical to Ray's. It reads plain local paths
only. It does not import Ray: a small rebuild in a fresh process must not pay for
loading it, let alone for starting it.

`raycap.rebuild` enters here. With executor "auto" (the default) or "local", when no
Ray is running or asked for, the directories are plain local paths and (for auto) the
captures are small enough to build before an embedded Ray would have started, the call
runs here; anything else goes to the Ray driver (`raycap.cluster.rebuild`), which
makes the same decision for its sessions.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import pyarrow as pa

from raycap.batch import build_in_runs, freeze_in, read_in, schema_of
from raycap.store import TokenCaptureStore

EXECUTORS = ("auto", "ray", "local")
LOCAL_MAX_BYTES = 1 << 30
LOCAL_BATCH_ROLLOUTS = 64
FREEZE_THREADS = 4


@dataclass(frozen=True)
class ExecutorChoice:
    """Which executor ran a call, and why (the job's summary reports it)."""

    executor: str
    reason: str
    # A first call on a running single-node Ray: this process builds alongside it.
    cold: bool = False


def plain_local_paths(specs: Sequence[Any]) -> list[str] | str:
    """The directory specs as local paths, or why they cannot be read in this process."""
    paths = []
    for spec in specs:
        node = getattr(spec, "node", None) if not isinstance(spec, Mapping) else spec.get("node")
        path = getattr(spec, "path", None) if not isinstance(spec, Mapping) else spec.get("path")
        if path is None and not isinstance(spec, Mapping):
            path = os.fspath(spec)
            if not path.startswith("/"):
                return f"capture directory {path} names a node or is not an absolute path"
        if node is not None:
            return f"capture directory {node}:{path} names a node"
        path = os.path.normpath(os.fspath(path))
        if not os.path.isdir(path):
            return f"capture directory {path} is not on this machine"
        paths.append(path)
    return paths


def ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def listed_ids(paths: Sequence[str], skip_retired: bool) -> list[str]:
    stores = [TokenCaptureStore(path, create=False) for path in paths]
    return sorted({rid for store in stores for rid in store.rollout_ids(skip_retired=skip_retired)})


def capture_bytes(paths: Sequence[str], rollout_ids: Sequence[str], limit: int) -> int:
    """The JSONL bytes of these rollouts over the directories, counted up to `limit`."""
    total = 0
    for path in paths:
        total += sum(TokenCaptureStore(path, create=False).held(rollout_ids).values())
        if total > limit:
            break
    return total


def missing_plain_path(specs: Sequence[Any]) -> str | None:
    """A plain-path spec (no node) whose directory is not on this machine, if any."""
    for spec in specs:
        node = spec.get("node") if isinstance(spec, Mapping) else getattr(spec, "node", None)
        path = spec.get("path") if isinstance(spec, Mapping) else getattr(spec, "path", None)
        if path is None and not isinstance(spec, Mapping):
            path = os.fspath(spec)
        if node is None and path is not None and str(path).startswith("/") and not os.path.isdir(path):
            return str(path)
    return None


def choose_without_ray(
    specs: Sequence[Any], rollout_ids: Sequence[str] | None, skip_retired: bool, address: str | None
) -> ExecutorChoice | None:
    """auto's choice when no Ray runs in this process: local, or None for Ray.

    Raises FileNotFoundError for a plain path that is not on this machine when Ray
    would be started here: an embedded Ray has no other machine to find it on."""
    if address or os.environ.get("RAY_ADDRESS"):
        return None
    missing = missing_plain_path(specs)
    if missing is not None:
        raise FileNotFoundError(
            f"capture directory {missing} does not exist on this machine, and no Ray cluster is running or "
            "given to look for it on; check the path, or pass address= to rebuild on a cluster"
        )
    paths = plain_local_paths(specs)
    if isinstance(paths, str):
        return None
    ids = listed_ids(paths, skip_retired) if rollout_ids is None else list(rollout_ids)
    total = capture_bytes(paths, ids, LOCAL_MAX_BYTES)
    if total > LOCAL_MAX_BYTES:
        return None
    return ExecutorChoice(
        "local",
        f"no Ray running or asked for, and {total / 1e6:.1f} MB of captures build in this process "
        "before an embedded Ray would have started",
    )


@dataclass
class Progress:
    """Rollouts done of the total, passed to a `progress` callback after each batch."""

    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0


def freeze_local_window(paths: Sequence[str], ids: list[str]) -> list[list]:
    """The freezes of a window's rollouts in each local directory (None where a
    directory does not hold one); an id no directory holds is frozen in the first one,
    like the single-rollout API."""
    stores = [TokenCaptureStore(path, create=False) for path in paths]
    held_only = len(stores) > 1
    frozen = [freeze_in(store, ids, held_only=held_only, threads=FREEZE_THREADS) for store in stores]
    nowhere = [i for i in range(len(ids)) if all(batch[i] is None for batch in frozen)]
    if nowhere:
        fresh = freeze_in(stores[0], [ids[i] for i in nowhere], held_only=False, threads=FREEZE_THREADS)
        for i, part in zip(nowhere, fresh):
            frozen[0][i] = part
    return frozen


class FreezeAhead:
    """Freezes the next window on a thread while this process builds the current one:
    freezing waits on fsyncs, building on the CPU, so the two overlap. Freezing is
    idempotent, so a window frozen ahead and then built elsewhere costs nothing wrong."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raycap-freeze-ahead")
        self.ahead: tuple[int, Future] | None = None

    def start(self, index: int, ids: list[str]) -> None:
        """Begin freezing window `index` (replacing any earlier unclaimed one)."""
        self.ahead = (index, self.pool.submit(freeze_local_window, self.paths, ids))

    def take(self, index: int, ids: list[str]) -> list[list]:
        """The freezes of window `index`: the ones made ahead, or made now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == index:
            return ahead[1].result()
        return freeze_local_window(self.paths, ids)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def build_local_window(
    paths: Sequence[str],
    labels: Sequence[str],
    index: int,
    ids: list[str],
    *,
    builder: str,
    model: str,
    delivery: str,
    verbose: bool = False,
    shard_dir: str | None = None,
    frozen: list[list] | None = None,
    version_key: str | None = None,
) -> Any:
    """One window built in this process exactly as a builder task builds it: its rows,
    or with `shard_dir` the ShardInfo of the shard written there. `frozen` is the
    window's freezes when they were made already (see FreezeAhead)."""
    stores = [TokenCaptureStore(path, create=False) for path in paths]
    if frozen is None:
        frozen = freeze_local_window(paths, ids)
    table = build_in_runs(
        ids, labels, frozen, lambda k, batch: read_in(stores[k], batch),
        builder=builder, model=model, delivery=delivery, verbose=verbose, version_key=version_key,
    )
    if shard_dir is None:
        return table
    from raycap.output import write_shard

    return write_shard(shard_dir, index, table)


def iter_local(
    paths: Sequence[str],
    labels: Sequence[str],
    rollout_ids: Sequence[str] | None,
    *,
    builder: str,
    model: str,
    delivery: str,
    batch_size: int | None = None,
    skip_retired: bool = False,
    shard_dir: str | None = None,
    progress: Callable[[Progress], None] | None = None,
    verbose: bool = False,
    version_key: str | None = None,
) -> Iterator[Any]:
    """The local executor: windows of rows (or shards) in the order of the ids."""
    ids = listed_ids(paths, skip_retired) if rollout_ids is None else list(rollout_ids)
    state = Progress(total=len(ids))
    if progress:
        progress(state)
    step = batch_size or LOCAL_BATCH_ROLLOUTS
    windows = [ids[start : start + step] for start in range(0, len(ids), step)]
    ahead = FreezeAhead(paths)
    try:
        for index, window in enumerate(windows):
            frozen = ahead.take(index, window)
            if index + 1 < len(windows):
                ahead.start(index + 1, windows[index + 1])
            yield build_local_window(
                paths, labels, index, window, builder=builder, model=model, delivery=delivery, verbose=verbose,
                shard_dir=shard_dir, frozen=frozen, version_key=version_key,
            )
            state.done += len(window)
            if progress:
                progress(state)
    finally:
        ahead.close()


def rebuild(
    capture_dirs: Sequence[Any],
    rollout_ids: Sequence[str] | None = None,
    *,
    builder: str = "prefix_merging",
    model: str = "",
    delivery: str = "rollout",
    batch_size: int | None = None,
    max_in_flight: int | None = None,
    progress: Callable[[Any], None] | None = None,
    address: str | None = None,
    skip_retired: bool = False,
    executor: str = "auto",
) -> pa.Table:
    """Rebuild rollouts from capture directories, on Ray or in this process.

    `delivery="rollout"` (the default) gives one row per rollout in ROLLOUT_SCHEMA, the
    single-response results of the spec; `delivery="chains"` gives one row per chain in
    CHAIN_SCHEMA (see raycap.chains). Rows come in the order of `rollout_ids`, or of the
    sorted ids found in any directory when it is None (retired tombstones included, each
    a masked "retired" row, unless `skip_retired`). `executor` is "auto", "ray" or
    "local" (see `raycap.Rebuilder`); a call that runs here does not import Ray."""
    if executor in ("auto", "local") and not ray_running() and builder_known(builder) and delivery_known(delivery):
        choice = choose_without_ray(capture_dirs, rollout_ids, skip_retired, address) if executor == "auto" else None
        paths = plain_local_paths(capture_dirs) if executor == "local" or choice is not None else None
        if isinstance(paths, list):
            tables = list(
                iter_local(
                    paths, paths, rollout_ids, builder=builder, model=model, delivery=delivery,
                    batch_size=batch_size, skip_retired=skip_retired, progress=progress,
                )
            )
            return pa.concat_tables(tables) if tables else schema_of(delivery).empty_table()
    from raycap.cluster.rebuild import rebuild as on_ray

    return on_ray(
        capture_dirs, rollout_ids, builder=builder, model=model, delivery=delivery, batch_size=batch_size,
        max_in_flight=max_in_flight, progress=progress, address=address, skip_retired=skip_retired,
        executor=executor,
    )


def builder_known(name: str) -> bool:
    from raycap.builders import BUILDERS

    return name in BUILDERS


def delivery_known(name: str) -> bool:
    from raycap.batch import DELIVERIES

    return name in DELIVERIES
