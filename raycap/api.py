"""The front door: `raycap.rebuild`, where a call's options and directories are checked once.

`rebuild` parses the directories (`raycap.capture.directory`), builds the call's
`RebuildOptions` and checks the ids, before anything is touched; then the one dispatch
(`raycap.runs.dispatch`) says where the call runs and hands it over. A call that runs in
this process does not import Ray; anything else goes to a cached Ray session.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import pyarrow as pa

from raycap.capture.directory import capture_dirs as parse_capture_dirs
from raycap.rows.batch import empty_rows
from raycap.rows.executor import Request
from raycap.rows.local import Progress
from raycap.rows.options import MAX_CAPTURE_BYTES, RebuildOptions, checked_rollout_ids
from raycap.runs.dispatch import executor_for


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
    a masked "retired" row, unless `skip_retired`). The keywords named
    like `raycap.rows.options.RebuildOptions`' fields are those options (see there).

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
    options = RebuildOptions.of(locals())
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
    runner, choice = executor_for(Request(dirs, ids, options, "rows", address))
    tables = list(runner.run(ids, options, progress=progress, choice=choice))
    return pa.concat_tables(tables) if tables else empty_rows(options.delivery, options.version_key)
