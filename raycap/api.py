"""The front door: `raycap.rebuild`, where a call's options and directories are checked once.

`rebuild` parses the directories (`raycap.capture.directory`), builds the call's
`RebuildOptions` and checks the ids, before anything is touched; then it asks
`raycap.rows.executor.decide` where the call runs. A call that runs in this process does not
import Ray; anything else goes to a cached Ray session (`raycap.cluster.session`), with
the choice already made when Ray was not running.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import pyarrow as pa

from raycap.capture.directory import capture_dirs as parse_capture_dirs
from raycap.rows.batch import empty_rows
from raycap.rows.executor import Request, decide_without_ray
from raycap.rows.local import Progress, iter_local
from raycap.rows.options import MAX_CAPTURE_BYTES, RebuildOptions, checked_rollout_ids


def rebuild(
    capture_dirs: Iterable[object],
    rollout_ids: Sequence[str] | None = None,
    *,
    builder: str = "prefix_merging",
    model: str = "",
    delivery: str = "rollout",
    batch_size: int | None = None,
    max_in_flight: int | None = None,
    progress: Callable[[Progress], None] | None = None,
    address: str | None = None,
    skip_retired: bool = False,
    executor: str = "auto",
    verbose: bool = False,
    max_capture_bytes: int | None = MAX_CAPTURE_BYTES,
) -> pa.Table:
    """Rebuild rollouts from capture directories, on Ray or in this process.

    `delivery="rollout"` (the default) gives one row per rollout in ROLLOUT_SCHEMA, the
    single-response results of the spec; `delivery="chains"` gives one row per chain in
    CHAIN_SCHEMA (see raycap.rows.chains). Rows come in the order of `rollout_ids`, or of the
    sorted ids found in any directory when it is None (retired tombstones included, each
    a masked "retired" row, unless `skip_retired`). Options (`builder`, `model`,
    `delivery`, `batch_size`, `max_in_flight`, `executor`, `verbose`,
    `max_capture_bytes`): see `raycap.rows.options.RebuildOptions`.

    Raises TypeError when `rollout_ids` is a single string, ValueError for an empty
    directory list or an invalid option (see `raycap.rows.options.RebuildOptions`).

    Examples:
        >>> import tempfile
        >>> import raycap
        >>> from raycap.cli.synth import CorpusSpec, generate_corpus
        >>> work = tempfile.mkdtemp()
        >>> spec = CorpusSpec(rollouts=3, turns=(4, 4), system_tokens=(8, 8), fault_share=0.0)
        >>> corpus = generate_corpus(f"{work}/captures", spec)
        >>> table = raycap.rebuild([f"{work}/captures"], executor="local")
        >>> table["rollout_id"].to_pylist(), table["mask_sample"].to_pylist()
        (['r0000', 'r0001', 'r0002'], [False, False, False])
    """
    ids = checked_rollout_ids(rollout_ids)
    dirs = parse_capture_dirs(capture_dirs)
    options = RebuildOptions(
        builder=builder, model=model, delivery=delivery, batch_size=batch_size, max_in_flight=max_in_flight,
        verbose=verbose, skip_retired=skip_retired, executor=executor, max_capture_bytes=max_capture_bytes,
    )
    return rebuild_with(dirs, ids, options, address=address, progress=progress)


def rebuild_with(
    dirs: Sequence[object],
    rollout_ids: Sequence[str] | None,
    options: RebuildOptions,
    *,
    address: str | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> pa.Table:
    """`rebuild` with its options as one value (the directories parsed or not)."""
    dirs = parse_capture_dirs(dirs)
    ids = checked_rollout_ids(rollout_ids)
    choice = decide_without_ray(Request(dirs, ids, options, "rows", address))
    if choice is not None and choice.executor == "local":
        tables = list(iter_local(dirs, ids, options, progress=progress))
        return pa.concat_tables(tables) if tables else empty_rows(options.delivery, options.version_key)
    from raycap.cluster.session import rebuild as on_ray

    return on_ray(dirs, ids, options, address=address, progress=progress, choice=choice)
