"""The builder tasks: the only code of the rebuild (and of finalizing results) that runs in Ray's workers.

A task gets one batch (consecutive rollout ids), the sources that may hold its rollouts
and, unless it freezes them itself (`frozen` None: every directory is on its node), each
source's freezes. It reads the frozen bytes on the directory's node, or through the
directory's actor elsewhere, builds the rows with `raycap.rows.batch` (so they cannot depend
on where they were built) and returns them, or writes them as a Parquet shard where it
runs and returns the shard's metadata. A training step's batch may be shared with the
process that submitted it (`claim`, `raycap.rows.claims`): the task builds it only if it
claims it first. Retrying it is safe: freezing is idempotent and a shard is written
whole or not at all. The finalize task (`finalize_one_batch`) does the
same for a batch of a results file's records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray

from raycap.capture.outcomes import Part
from raycap.capture.spares import Spares
from raycap.capture.store import FrozenCapture, TokenCaptureStore
from raycap.cluster.plumbing.placement import local_path
from raycap.finalize.batch import prepare_batch, write_batch
from raycap.rows.batch import DELIVERIES, IpcTable, build_batch, freeze_and_build, freeze_in, read_and_build, read_in
from raycap.rows.claims import Claim
from raycap.rows.options import RebuildOptions

TASK_MAX_RETRIES = 3
# Long enough for Ray to start the missing worker processes, short enough not to keep a
# warm worker from the next call (set by the first-call benchmark, `make bench`).
WARM_HOLD_S = 0.3


@dataclass(frozen=True)
class Source:
    """Where a batch's frozen parts come from: a directory, its node and its actor."""

    label: str
    path: str
    node: str
    # The directory's `raycap.cluster.nodes.actor.DirectoryHandle` (not imported here: the
    # node actor submits builder tasks itself, and imports this module).
    handle: Any


def with_data(source: Source, batch: list[Part], here: str) -> list[Part]:
    """Fill in the bytes of freezes made with read=False: read locally when this task
    runs on the directory's node, else ask the directory's actor for them."""
    wanted = [i for i, part in enumerate(batch) if isinstance(part, FrozenCapture) and part.size > len(part.data)]
    if not wanted:
        return batch
    if source.node == here:
        return read_in(TokenCaptureStore(local_path(source.path), create=False), batch)
    batch = list(batch)
    for i, part in zip(wanted, ray.get(source.handle.read_batch([batch[i] for i in wanted]))):
        batch[i] = part
    return batch


def freeze_here(rollout_ids: list[str], sources: list[Source], here: str, max_bytes: int | None) -> list[list[Part]]:
    """A batch's freezes, made by its builder task (identities and sizes only): in
    place on the directories of this node (no round trip), through the actor elsewhere.
    With several sources each is asked for the ids it holds; an id no directory holds
    is frozen in the first one, like the single-rollout API."""
    only_held = len(sources) > 1

    def freeze(source: Source, ids: list[str], held_only: bool) -> list[Part]:
        if source.node != here:
            return ray.get(source.handle.freeze_batch(ids, read=False, held_only=held_only, max_bytes=max_bytes))
        store = TokenCaptureStore(local_path(source.path), create=False)
        return freeze_in(store, ids, held_only=held_only, max_bytes=max_bytes)

    frozen = [freeze(source, rollout_ids, only_held) for source in sources]
    nowhere = [i for i in range(len(rollout_ids)) if all(batch[i] is None for batch in frozen)]
    if nowhere:
        for i, part in zip(nowhere, freeze(sources[0], [rollout_ids[i] for i in nowhere], False)):
            frozen[0][i] = part
    return frozen


def build_parts(
    rollout_ids: list[str], sources: list[Source], frozen: list[list[Part]], here: str, options: RebuildOptions
) -> pa.Table:
    """Read and build a batch's frozen parts (see `raycap.rows.batch.read_and_build`)."""
    return read_and_build(
        rollout_ids, [s.label for s in sources], frozen, lambda k, batch: with_data(sources[k], batch, here),
        builder=options.builder, model=options.model, delivery=options.delivery, verbose=options.verbose,
        version_key=options.version_key,
    )


@dataclass(frozen=True)
class SharedRows:
    """A builder task's answer for a shared batch: its rows, or None when the task lost the
    batch's claim (the submitter built it, or the claim is not visible where the task
    ran), and when it answered (`time.time()`: the submitter, on the same node, measures
    the task's pace by it)."""

    rows: IpcTable | None
    built_at: float


def build_one_batch(
    index: int,
    rollout_ids: list[str],
    sources: list[Source],
    frozen: list[list[Part]] | None,
    options: RebuildOptions,
    shard_dir: Any,
    spares: Spares | None = None,
    claim: Claim | None = None,
) -> Any:
    """Build batch `index`: `frozen[k][i]` is source k's freeze of rollout i (None where
    that directory does not hold it); `frozen` None asks the task to freeze (making its
    files from `spares` where it can, `raycap.capture.spares`). Returns the
    rows (IpcTable), or with `shard_dir` (a local staging directory's path, or an object
    store's staging attempt as a `raycap.output.location.Location`) the ShardInfo of the shard
    they were written to. With `claim` (a batch shared with its submitter, no shard), it
    builds only if it takes the claim, and returns SharedRows."""
    if claim is not None:
        rows = build_one_batch(index, rollout_ids, sources, frozen, options, None, spares) if claim.take() else None
        return SharedRows(rows, time.time())
    here = ray.get_runtime_context().get_node_id()
    if frozen is None and len(sources) == 1 and sources[0].node == here:
        # One directory, on this node: built while its freezes become durable.
        store = TokenCaptureStore(local_path(sources[0].path), create=False)
        table = freeze_and_build(
            store, rollout_ids, sources[0].label, max_bytes=options.max_capture_bytes, spares=spares,
            builder=options.builder, model=options.model, delivery=options.delivery, verbose=options.verbose,
            version_key=options.version_key,
        )
    else:
        if frozen is None:
            frozen = freeze_here(rollout_ids, sources, here, options.max_capture_bytes)
        table = build_parts(rollout_ids, sources, frozen, here, options)
    if shard_dir is None:
        return IpcTable(table)
    from raycap.output.shards import write_shard

    return write_shard(_staging_here(shard_dir), index, table)


def _staging_here(staging: Any) -> Any:
    """Where this task writes: a local staging directory as this node sees its path, an
    object store's staging attempt (a Location) as it is, straight to the store."""
    return staging if not isinstance(staging, str) else local_path(staging)


# The task the schedulers submit, looked up on this module when they submit, so a test
# can put a faulty task in its place (see tests/system/test_cluster_faults.py).
build_batch_task = ray.remote(num_cpus=1, max_retries=TASK_MAX_RETRIES)(build_one_batch)


def finalize_one_batch(
    data: bytes,
    batch: Any,
    label: str,
    sources: list[Source],
    options: RebuildOptions,
    fields: tuple[tuple[str, str], ...],
    staging: Any,
) -> Any:
    """Finalize one batch of a results file (`raycap.finalize.batch.prepare_batch`, then
    `write_batch`): its lines arrive as `data`, its rollouts are frozen here (in place on this node's
    directories, through the actor elsewhere), and its records part and shard are
    written into `staging` where this task runs. Returns the `FinalizedBatch`. Retrying
    it is safe: freezing is idempotent and both files are written whole or not at all."""
    here = ray.get_runtime_context().get_node_id()
    prepared = prepare_batch(
        bytes(data), batch, label=label, labels=[s.label for s in sources],
        freeze=lambda ids: freeze_here(ids, sources, here, options.max_capture_bytes),
        read=lambda k, parts: with_data(sources[k], parts, here), options=options, fields=fields,
    )
    return write_batch(prepared, _staging_here(staging))


finalize_batch_task = ray.remote(num_cpus=1, max_retries=TASK_MAX_RETRIES)(finalize_one_batch)


def warm_worker() -> None:
    """Build a tiny in-memory rollout in both deliveries: loads this module into a worker
    and runs, once, what builder tasks would otherwise initialise on their first batch."""
    line = (
        b'{"generation_log_probs":[-0.5],"generation_token_ids":[2],"model_call_id":"c",'
        b'"prompt_token_ids":[1],"rollout_id":"warm-up"}\n'
    )
    frozen = FrozenCapture("warm-up", "", 0, False, line, len(line))
    for delivery in DELIVERIES:
        build_batch(["warm-up"], [[("", frozen)]], builder="prefix_merging", model="", delivery=delivery)
    # Held a moment, so that the warm-ups of one call land on distinct workers (an idle
    # warm worker would otherwise take them all, and the others start cold later); see
    # WARM_HOLD_S.
    time.sleep(WARM_HOLD_S)


warm_task = ray.remote(num_cpus=1, max_retries=0)(warm_worker)
