"""The trainer's side: committed rows as a Ray Dataset, and fixed-shape token batches.

`dataset(output)` reads the committed shards of an output (`raycap.output.commit`) with Ray
Data: only the shards its manifest lists, so a half-written or rejected run is never read.
Blocks may be consumed out of order unless Ray Data is told to preserve order.
`collate` and `token_batches` (`raycap.train.collate`) turn rows into `TokenBatch` arrays
of a fixed width (`raycap.train.tokenbatch`); `DataParallelFeed` and `shard_batches`
(`raycap.train.parallel`) give data-parallel ranks equal step counts.
This module does not import Ray; `dataset` loads it. The rest uses only numpy and
pyarrow, so a trainer without Ray can feed itself from a committed output.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping

# The feed's names, importable from here as before the split.
from raycap.train.collate import (  # noqa: F401 - re-exported
    FEED_COLUMNS,
    TOKEN_COLUMNS,
    VERSION_FEED_COLUMNS,
    _column,
    _Packer,
    _Row,
    _rows,
    collate,
    has_versions,
    token_batches,
)
from raycap.train.parallel import DataParallelFeed, StepTokens, _first_fit, shard_batches  # noqa: F401 - re-exported
from raycap.train.tokenbatch import NO_VERSION, TORCH_DTYPES, TokenBatch, torch_tensors  # noqa: F401 - re-exported


def dataset(
    output: Any, columns: Iterable[str] | None = None, *, storage_options: Mapping[str, Any] | None = None,
    **read_args: Any,
) -> Any:
    """The committed rows of `output` as a Ray Dataset (`ray.data.read_parquet` of the
    shards its manifest lists). `columns` keeps only those columns (`select_columns`,
    which Ray Data pushes down into the read); `read_args` go to read_parquet. The shards
    are checked first (`raycap.output.manifest.shard_paths`: inside the output, regular files,
    no link; on an object store, every listed shard in place), since Ray Data opens them
    by path. `output` is a path, a URI (`s3://...`; `storage_options` go to its file
    system) or a `raycap.output.location.Location`."""
    from raycap.output.location import parse_location
    from raycap.output.protocol import backend_of

    location = parse_location(output, storage_options)
    backend = backend_of(location)
    shards = backend.shards(location)  # raises OutputError unless committed
    paths, filesystem = backend.for_workers(location, shards)
    if filesystem is not None:
        read_args.setdefault("filesystem", filesystem)
    import ray.data

    from raycap.cluster.plumbing.connect import connect
    from raycap.cluster.plumbing.console import quiet_ray_data

    # Connect as every raycap call does (RAY_ADDRESS's cluster, or a quiet embedded
    # instance) instead of letting Ray Data start one with its dashboard and notices.
    connect()
    quiet_ray_data()
    rows = _read_named_files(ray.data, paths, read_args)
    return rows if columns is None else rows.select_columns(list(columns))


_CONTEXT = threading.Lock()
# Options only Ray Data's listing reader (DataContext.use_datasource_v2) takes.
_LISTING_OPTIONS = ("ignore_missing_paths", "skip_paths")


def _read_named_files(data: Any, paths: list[str], read_args: dict[str, Any]) -> Any:
    """`read_parquet` of exactly the files `paths` names. Ray Data's listing reader (the
    default since Ray 2.5x) lists the paths and reads their footers in a pool of actors
    (32 new worker processes by default) before the first row: that pays off for a glob
    over a large bucket, but a manifest names every shard already, and on a small
    cluster those processes cost seconds per read. So the shards are read by the
    reader that takes a list of files, unless a read argument only the listing reader
    knows is given."""
    context = data.DataContext.get_current()
    if not getattr(context, "use_datasource_v2", False) or any(name in read_args for name in _LISTING_OPTIONS):
        return data.read_parquet(paths, **read_args)
    with _CONTEXT:  # the choice is read from the process's context when the read is planned
        context.use_datasource_v2 = False
        try:
            return data.read_parquet(paths, **read_args)
        finally:
            context.use_datasource_v2 = True
