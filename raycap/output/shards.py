"""A shard: one batch's rows, written durably by the builder task that built them.

Rows are written where they are built. Each builder task writes its batch as one shard,
`data/part-NNNNNN.parquet` named after the batch's position (`shard_name`, `write_shard`),
into the staging directory of the output (`raycap.output.commit.StagedOutput`): temp file,
fsync, rename, fsync the directory. It returns only a `ShardInfo`: the shard's name,
sizes, what retirement would drop, and the stats the summary needs
(`raycap.output.stats.ShardStats`), measured on the table still in its memory. A retried
task writes the same name and replaces its own shard, never adding a second.

Shard names sort in rollout order. `data` is not `key=value`, so no reader infers a
partition column from it. A manifest names its shards, and a manifest is untrusted input:
`shard_name_problem` says why a name is not one a manifest may list (only
`data/NAME.parquet`, or `NAME.parquet` at the top in an output written before `data/`,
with NAME a plain, visible file name), so no reader follows one out of the output.

`ShardInfo.sha256` is the digest of the shard's bytes, computed while they are written
(no read back), so a reader can tell that a shard is the one its manifest lists.

On an object store the staging is an attempt's prefix (a `raycap.output.location.Location`,
see `raycap.output.objectstore.writes`): the shard is written to memory, digested, and PUT whole,
straight from the task to the store, so no node needs a shared directory.

Builder tasks import this module, not `raycap.output.commit`. This module does not import Ray.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from raycap.observe import timing
from raycap.output.durable import fsync_dir, replace_durably
from raycap.output.faults import OutputError, store_fault, write_fault
from raycap.output.location import Location
from raycap.output.objectstore import client
from raycap.output.stats import ShardStats
from raycap.rows.arrow import retirable, without_versions
from raycap.rows.batch import schema_of

# The shards live in DATA_DIR, apart from the output's hidden metadata files
# (`raycap.output.manifest`): polars refuses a directory holding anything but Parquet, so
# `out/data` is a plain directory of shards.
DATA_DIR = "data"


def shard_name(index: int) -> str:
    """The shard of batch `index`, relative to the output: the same name on every
    attempt, sorting in batch order, inside DATA_DIR."""
    return "%s/part-%06d.parquet" % (DATA_DIR, index)


def shard_name_problem(name: Any) -> str | None:
    """Why `name` may not be listed as a shard by a manifest, or None when it may.

    A shard is `data/NAME.parquet`, or `NAME.parquet` at the top of an output written
    before `data/`; NAME is a plain file name, not hidden (`.` or `_` first: readers of
    the directory skip those). So no name is absolute, climbs out (`..`), has an empty
    component, a backslash or a control character."""
    if not isinstance(name, str):
        return f"which is not a string but of type {type(name).__name__}"
    if "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "which holds a backslash or a control character"
    if name.startswith("/"):
        return "which is an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "which climbs out of its directory (..)"
    if len(parts) == 2 and parts[0] == DATA_DIR:
        file = parts[1]
    elif len(parts) == 1:
        file = parts[0]
    else:
        return f"which is not {DATA_DIR}/NAME.parquet (a shard is a file of the output's {DATA_DIR} directory)"
    if not file or file.startswith((".", "_")):
        return "whose file name is empty or hidden"
    if not file.endswith(".parquet"):
        return "which is not a .parquet file"
    return None


class _Digesting:
    """A writable file that passes its bytes on and digests them on the way."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.digest, self.closed = handle, hashlib.sha256(), False

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.handle.write(data)

    def tell(self) -> int:
        return self.handle.tell()

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        self.closed = True  # the handle belongs to the caller


@dataclass(frozen=True)
class ShardInfo:
    """What a builder task reports for the shard it wrote: no rows, only metadata.

    `retirable` counts the rollouts whose snapshots retirement would drop (successful and
    unmasked in every row); `stats` is what the summary adds up. `sha256` is the hex
    digest of the file's bytes (None in a manifest written before it was recorded)."""

    name: str
    rows: int
    file_bytes: int
    arrow_bytes: int
    stats: ShardStats
    retirable: int
    sha256: str | None = None
    # The writing batch's stage seconds and bytes read (`raycap.observe.timing`), for
    # the driver's timings and metrics; never written to the manifest.
    figures: dict[str, float] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "rows": self.rows,
            "file_bytes": self.file_bytes,
            "arrow_bytes": self.arrow_bytes,
            "retirable": self.retirable,
            "stats": self.stats.to_json(),
        }
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ShardInfo":
        rows, file_bytes, digest = raw["rows"], raw["file_bytes"], raw.get("sha256")
        for key, value in (("rows", rows), ("file_bytes", file_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"shard {key} is not a count")
        if digest is not None and not isinstance(digest, str):
            raise ValueError("shard sha256 is not a string")
        return cls(
            name=raw["name"],
            rows=rows,
            file_bytes=file_bytes,
            arrow_bytes=raw["arrow_bytes"],
            stats=ShardStats.from_json(raw["stats"]),
            retirable=raw["retirable"],
            sha256=digest,
        )


def _delivery_of(schema: pa.Schema) -> str | None:
    # Rows with the version columns (a stream's, see raycap.rows.arrow) are of the delivery
    # they extend, and so are rows of rollout delivery with the fields of their records
    # carried by name after the schema's own (`record_fields`, see raycap.runs.rollouts).
    schema = without_versions(schema)
    if schema.equals(schema_of("chains"), check_metadata=False):
        return "chains"
    rollout = schema_of("rollout")
    head = pa.schema(list(schema)[: len(rollout)])
    extra = schema.names[len(rollout) :]
    if head.equals(rollout, check_metadata=False) and not set(extra) & set(schema_of("chains").names):
        return "rollout"
    return None


def write_shard(staging_dir: str | os.PathLike | Location, index: int, table: pa.Table) -> ShardInfo:
    """Write `table` durably as shard `index` of the staging directory (or an object
    store's staging attempt), replacing an earlier attempt's shard of the same batch;
    returns its metadata, measured from `table` (the file is never read back)."""
    if _delivery_of(table.schema) is None:
        raise OutputError(f"rows for shard {index} of {staging_dir} do not have the rollout or chain schema: {table.schema}")
    name = shard_name(index)
    with timing.stage("write"):
        file_bytes, sha256 = write_staged(staging_dir, name, lambda handle: pq.write_table(table, handle), "builds")
    return dataclasses.replace(_info(name, table, file_bytes, sha256), figures=timing.take_batch_figures())


def shard_writer(staging_dir: str | os.PathLike | Location | None) -> Callable[[int, pa.Table], ShardInfo] | None:
    """`write_shard` into `staging_dir`, as the local executor calls it with a batch's
    index and rows (`raycap.rows.local.iter_local`); None without a staging directory."""
    if staging_dir is None:
        return None
    return lambda index, table: write_shard(staging_dir, index, table)


def write_staged(
    staging_dir: str | os.PathLike | Location, name: str, write: Callable[[BinaryIO], None], who: str
) -> tuple[int, str]:
    """Write the file `name` (relative: `folder/file`) of a staging directory with
    `write(handle)`: durably (temp file, fsync, rename, directory fsync) into a local or
    shared directory, or PUT whole into an object store's staging attempt. Its size and
    the sha256 of its bytes, digested as they are written (nothing is read back). A
    retried writer replaces its own file. `who` says which nodes write there ("builds"),
    for the error when the staging directory is not on this node."""
    if isinstance(staging_dir, Location) and not staging_dir.local:
        sink = io.BytesIO()
        write(sink)
        data = sink.getvalue()
        try:
            client.put_bytes(staging_dir.child(name), data)
        except OSError as exc:
            raise store_fault(staging_dir, exc) from None
        return len(data), hashlib.sha256(data).hexdigest()
    staging_dir = staging_dir.path if isinstance(staging_dir, Location) else Path(staging_dir)
    if not staging_dir.is_dir():
        raise OutputError(
            f"staging directory {staging_dir} does not exist on this node; the output must be on "
            f"storage every node that {who} can see (a shared file system)"
        )
    folder = (staging_dir / name).parent
    if not folder.is_dir():  # StagedOutput makes it; a directory given by hand may lack it
        try:
            folder.mkdir(exist_ok=True)
            fsync_dir(staging_dir)
        except OSError as exc:
            raise write_fault(folder, exc) from None
    digests = []

    def digested(handle: BinaryIO) -> None:
        digesting = _Digesting(handle)
        digests.append(digesting.digest)  # the last attempt's, should the writer be retried
        write(digesting)

    file_bytes = replace_durably(staging_dir / name, digested, direct=True)
    return file_bytes, digests[-1].hexdigest()


def _info(name: str, table: pa.Table, file_bytes: int, sha256: str) -> ShardInfo:
    return ShardInfo(
        name=name,
        rows=table.num_rows,
        file_bytes=file_bytes,
        arrow_bytes=table.nbytes,
        stats=ShardStats.from_table(table),
        retirable=len({rollout_id for _, rollout_id, _, _ in retirable(table)}),
        sha256=sha256,
    )
