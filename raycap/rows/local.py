"""The local executor: batches built in this process, exactly as a builder task builds them.

It builds with `raycap.rows.batch`, as builder tasks do, in this process on one core, so its
rows are identical to Ray's. It reads plain local paths only (`raycap.capture.directory`). It
does not import Ray: a small rebuild in a fresh process must not pay for loading it, let
alone for starting it. Whether a call runs here is decided by `raycap.rows.executor.decide`;
the cold first-call plan (`raycap.cluster.rebuild.cold`) builds its front batches here too.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

from raycap.capture.directory import CaptureDir
from raycap.capture.outcomes import Part
from raycap.capture.spares import SparePool, Spares
from raycap.capture.store import TokenCaptureStore
from raycap.observe.progress import Progress as Progress  # the progress state every executor reports
from raycap.rows.batch import freeze_in, read_and_build, read_in
from raycap.rows.executor import listed_ids
from raycap.rows.options import RebuildOptions

LOCAL_BATCH_ROLLOUTS = 64


def freeze_local_batch(
    paths: Sequence[str], ids: list[str], max_bytes: int | None, spares: Spares | None = None
) -> list[list[Part]]:
    """The freezes of a batch's rollouts in each local directory (None where a
    directory does not hold one); an id no directory holds is frozen in the first one,
    like the single-rollout API. `spares`: the spare files of a single directory
    (`raycap.capture.spares`)."""
    stores = [TokenCaptureStore(path, create=False) for path in paths]
    held_only = len(stores) > 1
    frozen = [freeze_in(store, ids, held_only=held_only, max_bytes=max_bytes, spares=spares) for store in stores]
    nowhere = [i for i in range(len(ids)) if all(batch[i] is None for batch in frozen)]
    if nowhere:
        fresh = freeze_in(stores[0], [ids[i] for i in nowhere], held_only=False, max_bytes=max_bytes)
        for i, part in zip(nowhere, fresh):
            frozen[0][i] = part
    return frozen


class FreezeAhead:
    """Freezes the next batch on a thread while this process builds the current one:
    freezing waits on fsyncs, building on the CPU, so the two overlap. Freezing is
    idempotent, so a batch frozen ahead and then built elsewhere costs nothing wrong."""

    def __init__(self, paths: Sequence[str], max_bytes: int | None, spares: SparePool | None = None):
        self.paths = list(paths)
        self.max_bytes = max_bytes
        self.spares = spares  # the directory's spare files, for a training step's freezes
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raycap-freeze-ahead")
        self.ahead: tuple[int, Future] | None = None

    def start(self, index: int, ids: list[str]) -> None:
        """Begin freezing batch `index` (replacing any earlier unclaimed one)."""
        self.ahead = (index, self.pool.submit(freeze_local_batch, self.paths, ids, self.max_bytes, self._spares(ids)))

    def take(self, index: int, ids: list[str]) -> list[list[Part]]:
        """The freezes of batch `index`: the ones made ahead, or made now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == index:
            return ahead[1].result()
        return freeze_local_batch(self.paths, ids, self.max_bytes, self._spares(ids))

    def _spares(self, ids: list[str]) -> Spares | None:
        return self.spares.take(len(ids)) if self.spares is not None else None

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def build_local_batch(
    dirs: Sequence[CaptureDir],
    index: int,
    ids: list[str],
    options: RebuildOptions,
    *,
    write: Callable[[int, Any], Any] | None = None,
    frozen: list[list[Part]] | None = None,
) -> Any:
    """One batch built in this process exactly as a builder task builds it: its rows,
    or with `write` what `write(index, rows)` returns (a shard writer's ShardInfo:
    `raycap.output.shards.shard_writer`). `frozen` is the batch's freezes when they were
    made already (see FreezeAhead)."""
    paths = [d.path for d in dirs]
    stores = [TokenCaptureStore(path, create=False) for path in paths]
    if frozen is None:
        frozen = freeze_local_batch(paths, ids, options.max_capture_bytes)
    table = read_and_build(
        ids, [d.label for d in dirs], frozen, lambda k, batch: read_in(stores[k], batch),
        builder=options.builder, model=options.model, delivery=options.delivery, verbose=options.verbose,
        version_key=options.version_key,
    )
    return table if write is None else write(index, table)


def local_ids(dirs: Sequence[CaptureDir], rollout_ids: Sequence[str] | None, skip_retired: bool) -> list[str]:
    """The ids a call builds: the given ones, or those listed in the local directories."""
    if rollout_ids is None:
        return listed_ids(tuple(d.path for d in dirs), skip_retired)
    return list(rollout_ids)


def iter_local(
    dirs: Sequence[CaptureDir],
    rollout_ids: Sequence[str] | None,
    options: RebuildOptions,
    *,
    write: Callable[[int, Any], Any] | None = None,
    progress: Callable[[Progress], None] | None = None,
    spares: SparePool | None = None,
) -> Iterator[Any]:
    """The local executor: batches of rows (or, with `write`, what it returns for each:
    see `build_local_batch`) in the order of the ids; with
    `spares` (one directory's, `raycap.capture.spares`) its freezes rename spare files
    into place, and the pool makes more once the call is done."""
    ids = local_ids(dirs, rollout_ids, options.skip_retired)
    state = Progress(total=len(ids))
    if progress:
        progress(state)
    step = options.batch_size or LOCAL_BATCH_ROLLOUTS
    batches = [ids[start : start + step] for start in range(0, len(ids), step)]
    ahead = FreezeAhead([d.path for d in dirs], options.max_capture_bytes, spares)
    try:
        for index, batch in enumerate(batches):
            frozen = ahead.take(index, batch)
            if index + 1 < len(batches):
                ahead.start(index + 1, batches[index + 1])
            yield build_local_batch(dirs, index, batch, options, write=write, frozen=frozen)
            state.done += len(batch)
            if progress:
                progress(state)
    finally:
        ahead.close()
        if spares is not None:
            spares.refill(len(ids))
