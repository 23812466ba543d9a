"""A shard: one batch's rows, written durably by the builder task that built them.

Rows are written where they are built. Each builder task writes its batch as one shard,
`data/part-NNNNNN.parquet` named after the batch's position (`shard_name`, `write_shard`),
into the staging directory of the output (`raycap.output.StagedOutput`): temp file,
fsync, rename, fsync the directory. It returns only a `ShardInfo`: the shard's name,
sizes, what retirement would drop, and the stats the summary needs
(`raycap.shardstats.ShardStats`), measured on the table still in its memory. A retried
task writes the same name and replaces its own shard, never adding a second.

Shard names sort in rollout order. `data` is not `key=value`, so no reader infers a
partition column from it.

Builder tasks import this module, not `raycap.output`. This module does not import Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from raycap.arrow import retirable, without_versions
from raycap.batch import DELIVERIES, schema_of
from raycap.durable import fsync_dir, replace_durably
from raycap.outputerrors import OutputError, write_fault
from raycap.shardstats import ShardStats

# The shards live in DATA_DIR, apart from the output's hidden metadata files
# (`raycap.manifest`): polars refuses a directory holding anything but Parquet, so
# `out/data` is a plain directory of shards.
DATA_DIR = "data"


def shard_name(index: int) -> str:
    """The shard of batch `index`, relative to the output: the same name on every
    attempt, sorting in batch order, inside DATA_DIR."""
    return "%s/part-%06d.parquet" % (DATA_DIR, index)


@dataclass(frozen=True)
class ShardInfo:
    """What a builder task reports for the shard it wrote: no rows, only metadata.

    `retirable` counts the rollouts whose snapshots retirement would drop (successful and
    unmasked in every row); `stats` is what the summary adds up."""

    name: str
    rows: int
    file_bytes: int
    arrow_bytes: int
    stats: ShardStats
    retirable: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rows": self.rows,
            "file_bytes": self.file_bytes,
            "arrow_bytes": self.arrow_bytes,
            "retirable": self.retirable,
            "stats": self.stats.to_json(),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ShardInfo":
        return cls(
            name=raw["name"],
            rows=raw["rows"],
            file_bytes=raw["file_bytes"],
            arrow_bytes=raw["arrow_bytes"],
            stats=ShardStats.from_json(raw["stats"]),
            retirable=raw["retirable"],
        )


def _delivery_of(schema: pa.Schema) -> str | None:
    # Rows with the version columns (a stream's, see raycap.arrow) are of the delivery
    # they extend.
    schema = without_versions(schema)
    for delivery in DELIVERIES:
        if schema.equals(schema_of(delivery), check_metadata=False):
            return delivery
    return None


def write_shard(staging_dir: str | os.PathLike, index: int, table: pa.Table) -> ShardInfo:
    """Write `table` durably as shard `index` of the staging directory, replacing an
    earlier attempt's shard of the same batch; returns its metadata, measured from
    `table` (the file is never read back)."""
    staging_dir = Path(staging_dir)
    if _delivery_of(table.schema) is None:
        raise OutputError(f"rows for shard {index} of {staging_dir} do not have the rollout or chain schema: {table.schema}")
    if not staging_dir.is_dir():
        raise OutputError(
            f"staging directory {staging_dir} does not exist on this node; the output must be on "
            "storage every node that builds can see (a shared file system)"
        )
    data = staging_dir / DATA_DIR
    if not data.is_dir():  # StagedOutput makes it; a directory given by hand may lack it
        try:
            data.mkdir(exist_ok=True)
            fsync_dir(staging_dir)
        except OSError as exc:
            raise write_fault(data, exc) from None
    name = shard_name(index)
    file_bytes = replace_durably(staging_dir / name, lambda handle: pq.write_table(table, handle))
    return ShardInfo(
        name=name,
        rows=table.num_rows,
        file_bytes=file_bytes,
        arrow_bytes=table.nbytes,
        stats=ShardStats.from_table(table),
        retirable=len({rollout_id for _, rollout_id, _, _ in retirable(table)}),
    )
