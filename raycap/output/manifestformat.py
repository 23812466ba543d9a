"""What a committed output's manifest says: `Manifest`, its JSON, and the names of an output's metadata files.

The commit (`raycap.output.protocol.StagedOutput.commit`) writes `.manifest.json`: the
inputs and their fingerprint, the row schema, the ordered shards with their stats, the
totals. Parsing (`Manifest.from_json`) refuses a shard name that is not a plain name
inside the output (`raycap.output.shards.shard_name_problem`), a shard listed twice and a
staging attempt that is not an attempt's name, so no reader and no retirement follows
a manifest out of its output. How a manifest is read is each backend's
(`raycap.output.local.reads`, `raycap.output.objectstore.reads`); the readers' public face is
`raycap.output.manifest`.

This module does not import Ray.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from raycap.capture.untrusted import bounded_repr
from raycap.output.faults import OutputError
from raycap.output.location import Location
from raycap.output.recordparts import RecordsManifest
from raycap.output.shards import ShardInfo, shard_name_problem
from raycap.output.stats import Percentiles, ShardStats

# The metadata files are hidden (a leading dot): Hugging Face `datasets` reads every
# visible file of a directory as Parquet.
MANIFEST_NAME = ".manifest.json"
RETIRE_MARKER_NAME = ".retire.json"
# Where outputs written before the `data/` layout keep them; still read, never written
# to a new output.
LEGACY_MANIFEST_NAME = "_manifest.json"
LEGACY_RETIRE_MARKER_NAME = "_retire.json"
MANIFEST_FORMAT = "raycap.dataset"
MANIFEST_FORMAT_VERSION = 1
# The version of the row schemas (`raycap.rows.arrow`): bump it when a column changes meaning,
# so a reader can tell which rows it holds. 2: the record columns (`RECORD_COLUMNS`:
# reward, task_index, ...) follow the build's; an output of version 1 has none of them,
# and every reader takes it as it is (a missing record column reads as absent).
SCHEMA_VERSION = 2
# The most raycap reads of a manifest (a few hundred bytes per shard: a million shards)
# and of a retire marker: anything larger is not one raycap wrote.
MAX_MANIFEST_BYTES = 256 << 20
MAX_MARKER_BYTES = 1 << 20


def utc_now() -> str:
    """The time a manifest or the retire marker records: UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- the manifest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A committed output's `.manifest.json`: where its rows are and what they say.

    Shards are in rollout order. Their stats come without delivered fractions (see
    `raycap.output.summary`); `delivered_fraction` holds the whole output's percentiles."""

    path: Path | Location
    schema: str  # "rollout" or "chains"
    schema_version: int
    fingerprint: str
    inputs: dict[str, Any]
    shards: tuple[ShardInfo, ...]
    totals: ShardStats
    delivered_fraction: Percentiles | None
    committed_at: str
    # Where the commit put the output (its real parent, and its name). Retirement is
    # allowed only there: a copy, a staging directory or a set-aside output carries the
    # same manifest but is not the committed dataset.
    committed_as: str | None = None
    # An output of `raycap.finalize_rollouts`: its finalized records (`.records/` parts)
    # and their counts; None for rows alone.
    records: RecordsManifest | None = None
    # On an object store: the staging attempt the listed objects were committed from,
    # which a roll-forward copies them from (`raycap.output.objectstore.writes`); None locally.
    staged_as: str | None = None

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def file_bytes(self) -> int:
        return sum(s.file_bytes for s in self.shards)

    @property
    def arrow_bytes(self) -> int:
        return sum(s.arrow_bytes for s in self.shards)

    @property
    def retirable(self) -> int:
        return sum(s.retirable for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        d = self.delivered_fraction
        return {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "schema": self.schema,
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "inputs": self.inputs,
            "committed_at": self.committed_at,
            "committed_as": self.committed_as,
            "rows": self.rows,
            "rollouts": self.totals.rollouts,
            "file_bytes": self.file_bytes,
            "arrow_bytes": self.arrow_bytes,
            "retirable": self.retirable,
            "totals": self.totals.to_json(),
            "delivered_fraction": None if d is None else {"p10": d.p10, "p50": d.p50, "p90": d.p90},
            "shards": [s.to_json() for s in self.shards],
            **({} if self.records is None else {"records": self.records.to_json()}),
            **({} if self.staged_as is None else {"staged_as": self.staged_as}),
        }

    @classmethod
    def from_json(cls, path: Path | Location, raw: dict[str, Any]) -> "Manifest":
        """The manifest of the output `path` from its JSON. Shard names are checked
        here, where every reader's manifest is parsed: OutputError (one line) for a name
        that is not a plain name inside the output, or a shard listed twice."""
        if not isinstance(raw, dict):
            raise ValueError("it is not a JSON object")
        if raw.get("format") != MANIFEST_FORMAT or raw.get("format_version") != MANIFEST_FORMAT_VERSION:
            raise ValueError(f"not a {MANIFEST_FORMAT} manifest of version {MANIFEST_FORMAT_VERSION}")
        if not isinstance(raw["shards"], list):
            raise ValueError("its shards are not a list")
        shards = tuple(ShardInfo.from_json(s) for s in raw["shards"])
        _check_shard_names(path, (s.name for s in shards))
        d = raw["delivered_fraction"]
        return cls(
            path=path,
            schema=raw["schema"],
            schema_version=raw["schema_version"],
            fingerprint=raw["fingerprint"],
            inputs=raw["inputs"],
            shards=shards,
            totals=ShardStats.from_json(raw["totals"]),
            delivered_fraction=None if d is None else Percentiles(d["p10"], d["p50"], d["p90"]),
            committed_at=raw["committed_at"],
            committed_as=raw.get("committed_as"),
            records=None if raw.get("records") is None else RecordsManifest.from_json(path, raw["records"]),  # type: ignore[arg-type]
            staged_as=_staged_as(raw.get("staged_as")),
        )


# A staging attempt's name (`raycap.output.objectstore.writes`): its UTC start and a random part.
_ATTEMPT = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{12}$")


def is_attempt_name(name: Any) -> bool:
    """Whether `name` is a staging attempt's name (a manifest is untrusted input)."""
    return isinstance(name, str) and _ATTEMPT.match(name) is not None


def _staged_as(value: Any) -> str | None:
    """A manifest's staging attempt, which must be an attempt's name: a roll-forward
    copies only from `.NAME.staging/<attempt>/` beside the output."""
    if value is not None and not is_attempt_name(value):
        raise ValueError(f"its staged_as {bounded_repr(value)} is not the name of a staging attempt")
    return value


def _check_shard_names(output: Path | Location, names: Iterable[Any]) -> None:
    seen: set[str] = set()
    for name in names:
        problem = shard_name_problem(name)
        if problem is None and name in seen:
            problem = "which it lists twice"
        if problem is not None:
            raise OutputError(
                f"the manifest of {output} lists shard {bounded_repr(name)}, {problem}; nothing of the output was "
                "read: a shard must be a plain name inside the output (data/NAME.parquet); restore the manifest, "
                "or rebuild the output"
            )
        seen.add(name)
