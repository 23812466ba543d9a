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

from raycap.batch import MAX_CAPTURE_BYTES, build_in_runs, checked_max_capture_bytes, freeze_in, read_in, schema_of
from raycap.store import TokenCaptureStore, is_valid_rollout_id

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


def node_and_path(spec: Any) -> tuple[Any, Any]:
    if isinstance(spec, Mapping):
        return spec.get("node"), spec.get("path")
    path = getattr(spec, "path", None)
    if path is None:
        text = os.fspath(spec)
        if not text.startswith("/") and ":/" in text:
            node, rest = text.split(":/", 1)
            return node, "/" + rest
        return None, text
    return getattr(spec, "node", None), path


def unique_dirs(specs: Sequence[Any]) -> list[Any]:
    """The directory specs without repeats, first mention kept: two specs of one node
    whose paths resolve to the same real directory are one directory (read twice, its
    rollouts would come in two parts each and be masked)."""
    seen: set[tuple[Any, str]] = set()
    out = []
    for spec in specs:
        node, path = node_and_path(spec)
        # A node-qualified path may name a directory of another machine: only a plain
        # path can be resolved here.
        where = os.path.normpath(os.fspath(path)) if node is not None or path is None else os.path.realpath(path)
        key = (node, where)
        if key not in seen:
            seen.add(key)
            out.append(spec)
    return out


@dataclass(frozen=True)
class Request:
    """A rebuild's arguments checked at the front door: the directories (repeats
    removed) and the rollout ids as a tuple (None: every listed rollout)."""

    capture_dirs: tuple[Any, ...]
    rollout_ids: tuple[str, ...] | None


def check_request(
    capture_dirs: Sequence[Any],
    rollout_ids: Sequence[str] | None = None,
    *,
    batch_size: int | None = None,
    max_in_flight: int | None = None,
) -> Request:
    """Check a call's arguments before anything is read or written.

    `rollout_ids` given as one string or bytes raises TypeError (iterated, its
    characters would become rollouts); an empty directory list, a batch_size or
    max_in_flight below 1 raise ValueError, and so do repeated ids: each rollout is
    built, written and retired once, so a repeat is refused rather than doubled."""
    if isinstance(capture_dirs, (str, bytes, os.PathLike)):
        raise TypeError(f"capture_dirs must be a list of directories, not one {type(capture_dirs).__name__}; wrap it in a list")
    dirs = tuple(unique_dirs(list(capture_dirs)))
    if not dirs:
        raise ValueError("no capture directories given; pass at least one directory")
    if isinstance(rollout_ids, (str, bytes, bytearray)):
        raise TypeError(
            f"rollout_ids must be a list of ids, not one {type(rollout_ids).__name__} ({rollout_ids!r:.40}); "
            "wrap a single id in a list"
        )
    ids = None if rollout_ids is None else tuple(rollout_ids)
    if ids is not None:
        counts: dict[Any, int] = {}
        for rollout_id in ids:
            try:
                counts[rollout_id] = counts.get(rollout_id, 0) + 1
            except TypeError:
                raise TypeError(f"rollout id {rollout_id!r} is not a string; give ids as strings") from None
        repeated = [rollout_id for rollout_id, n in counts.items() if n > 1]
        if repeated:
            raise ValueError(
                f"rollout ids given more than once: {', '.join(map(str, repeated[:5]))}"
                f"{' ..' if len(repeated) > 5 else ''}; give each id once"
            )
    for name, value in (("batch_size", batch_size), ("max_in_flight", max_in_flight)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")
    return Request(dirs, ids)


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
        # Invalid ids hold nothing; each is its own masked row when built.
        valid = [r for r in rollout_ids if is_valid_rollout_id(r)]
        total += sum(TokenCaptureStore(path, create=False).held(valid).values())
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


def freeze_local_window(paths: Sequence[str], ids: list[str], max_bytes: int | None = MAX_CAPTURE_BYTES) -> list[list]:
    """The freezes of a window's rollouts in each local directory (None where a
    directory does not hold one); an id no directory holds is frozen in the first one,
    like the single-rollout API."""
    stores = [TokenCaptureStore(path, create=False) for path in paths]
    held_only = len(stores) > 1
    frozen = [freeze_in(store, ids, held_only=held_only, threads=FREEZE_THREADS, max_bytes=max_bytes) for store in stores]
    nowhere = [i for i in range(len(ids)) if all(batch[i] is None for batch in frozen)]
    if nowhere:
        fresh = freeze_in(
            stores[0], [ids[i] for i in nowhere], held_only=False, threads=FREEZE_THREADS, max_bytes=max_bytes
        )
        for i, part in zip(nowhere, fresh):
            frozen[0][i] = part
    return frozen


class FreezeAhead:
    """Freezes the next window on a thread while this process builds the current one:
    freezing waits on fsyncs, building on the CPU, so the two overlap. Freezing is
    idempotent, so a window frozen ahead and then built elsewhere costs nothing wrong."""

    def __init__(self, paths: Sequence[str], max_bytes: int | None = MAX_CAPTURE_BYTES):
        self.paths = list(paths)
        self.max_bytes = max_bytes
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raycap-freeze-ahead")
        self.ahead: tuple[int, Future] | None = None

    def start(self, index: int, ids: list[str]) -> None:
        """Begin freezing window `index` (replacing any earlier unclaimed one)."""
        self.ahead = (index, self.pool.submit(freeze_local_window, self.paths, ids, self.max_bytes))

    def take(self, index: int, ids: list[str]) -> list[list]:
        """The freezes of window `index`: the ones made ahead, or made now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == index:
            return ahead[1].result()
        return freeze_local_window(self.paths, ids, self.max_bytes)

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
    max_capture_bytes: int | None = MAX_CAPTURE_BYTES,
) -> Any:
    """One window built in this process exactly as a builder task builds it: its rows,
    or with `shard_dir` the ShardInfo of the shard written there. `frozen` is the
    window's freezes when they were made already (see FreezeAhead)."""
    stores = [TokenCaptureStore(path, create=False) for path in paths]
    if frozen is None:
        frozen = freeze_local_window(paths, ids, max_capture_bytes)
    table = build_in_runs(
        ids, labels, frozen, lambda k, batch: read_in(stores[k], batch),
        builder=builder, model=model, delivery=delivery, verbose=verbose,
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
    max_capture_bytes: int | None = MAX_CAPTURE_BYTES,
) -> Iterator[Any]:
    """The local executor: windows of rows (or shards) in the order of the ids."""
    ids = listed_ids(paths, skip_retired) if rollout_ids is None else list(rollout_ids)
    state = Progress(total=len(ids))
    if progress:
        progress(state)
    step = batch_size or LOCAL_BATCH_ROLLOUTS
    windows = [ids[start : start + step] for start in range(0, len(ids), step)]
    ahead = FreezeAhead(paths, max_capture_bytes)
    try:
        for index, window in enumerate(windows):
            frozen = ahead.take(index, window)
            if index + 1 < len(windows):
                ahead.start(index + 1, windows[index + 1])
            yield build_local_window(
                paths, labels, index, window, builder=builder, model=model, delivery=delivery, verbose=verbose,
                shard_dir=shard_dir, frozen=frozen,
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
    max_capture_bytes: int | None = MAX_CAPTURE_BYTES,
) -> pa.Table:
    """Rebuild rollouts from capture directories, on Ray or in this process.

    `delivery="rollout"` (the default) gives one row per rollout in ROLLOUT_SCHEMA, the
    single-response results of the spec; `delivery="chains"` gives one row per chain in
    CHAIN_SCHEMA (see raycap.chains). Rows come in the order of `rollout_ids`, or of the
    sorted ids found in any directory when it is None (retired tombstones included, each
    a masked "retired" row, unless `skip_retired`). `executor` is "auto", "ray" or
    "local" (see `raycap.Rebuilder`); a call that runs here does not import Ray. A rollout
    whose capture is larger than `max_capture_bytes` (None: no limit) is a masked row.

    The arguments are checked first (`check_request`): ids as one string, repeated
    ids, no directory, batch_size or max_in_flight below 1 are refused before anything
    is read; directories that resolve to one real directory are read once."""
    checked_max_capture_bytes(max_capture_bytes)
    request = check_request(capture_dirs, rollout_ids, batch_size=batch_size, max_in_flight=max_in_flight)
    capture_dirs, rollout_ids = list(request.capture_dirs), request.rollout_ids
    if executor in ("auto", "local") and not ray_running() and builder_known(builder) and delivery_known(delivery):
        choice = choose_without_ray(capture_dirs, rollout_ids, skip_retired, address) if executor == "auto" else None
        paths = plain_local_paths(capture_dirs) if executor == "local" or choice is not None else None
        if isinstance(paths, list):
            tables = list(
                iter_local(
                    paths, paths, rollout_ids, builder=builder, model=model, delivery=delivery,
                    batch_size=batch_size, skip_retired=skip_retired, progress=progress,
                    max_capture_bytes=max_capture_bytes,
                )
            )
            return pa.concat_tables(tables) if tables else schema_of(delivery).empty_table()
    from raycap.cluster.rebuild import rebuild as on_ray

    return on_ray(
        capture_dirs, rollout_ids, builder=builder, model=model, delivery=delivery, batch_size=batch_size,
        max_in_flight=max_in_flight, progress=progress, address=address, skip_retired=skip_retired,
        executor=executor, max_capture_bytes=max_capture_bytes,
    )


def builder_known(name: str) -> bool:
    from raycap.builders import BUILDERS

    return name in BUILDERS


def delivery_known(name: str) -> bool:
    from raycap.batch import DELIVERIES

    return name in DELIVERIES
