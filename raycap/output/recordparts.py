"""The finalized records of an output: JSONL parts in its hidden `.records/` folder.

`raycap.finalize_rollouts` writes, beside the rows, every record of the results file it
finalized, as NeMo Gym's finalizer leaves it. Each batch task writes its batch's records
as one part, `.records/part-NNNNNN.jsonl` (`write_records_part`), durably as shards are
written (temp file, fsync, rename, fsync the directory) into the output's staging
directory, and reports a `RecordsPart`: its name, the position of its first record, how
many it holds, its bytes and sha256, and the snapshots of its redundant captures
(records that carry their own token ids, whose captures have no row but may be
retired). The commit lists the parts in the manifest (`RecordsManifest`, with the
outcome counts `RecordCounts`), so retirement reads what to drop from the committed
output alone, and `raycap.read_records` yields the records in input order.

The folder is hidden (a leading dot), so every reader of the output as one Parquet
table (pyarrow, pandas, DuckDB, Ray Data, Hugging Face `datasets`; polars on `out/data`)
skips it. A manifest is untrusted input: `records_part_name_problem` says why a name is
not one it may list (only `.records/NAME.jsonl`, NAME a plain visible file name), and
`raycap.output.manifest.read_records_part` reads a part through the output's backend,
checked against its manifest entry (locally: never through a link or waiting on a FIFO,
as shards are opened).

This module does not import Ray.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping

from raycap.capture.maskreasons import record_reasons
from raycap.capture.untrusted import bounded_repr
from raycap.output.faults import OutputError
from raycap.output.location import Location
from raycap.output.shards import write_staged

RECORDS_DIR = ".records"


def records_part_name(index: int) -> str:
    """The records part of batch `index`, relative to the output: the same name on
    every attempt, sorting in batch order."""
    return "%s/part-%06d.jsonl" % (RECORDS_DIR, index)


def records_part_name_problem(name: Any) -> str | None:
    """Why `name` may not be listed as a records part by a manifest, or None when it
    may: a part is `.records/NAME.jsonl`, NAME a plain file name that is not hidden, so
    no name is absolute, climbs out, has a backslash or a control character."""
    if not isinstance(name, str):
        return f"which is not a string but of type {type(name).__name__}"
    if "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "which holds a backslash or a control character"
    parts = name.split("/")
    if len(parts) != 2 or parts[0] != RECORDS_DIR:
        return f"which is not {RECORDS_DIR}/NAME.jsonl (a records part is a file of the output's {RECORDS_DIR} folder)"
    file = parts[1]
    if not file or file in (".", "..") or file.startswith((".", "_")):
        return "whose file name is empty or hidden"
    if not file.endswith(".jsonl"):
        return "which is not a .jsonl file"
    return None


# --- what became of the records -------------------------------------------------------------


@dataclass
class RecordCounts:
    """The records of a results file by outcome, counted as a rollout collection counts
    them (SPEC 10.6): every record that got a build is `finalized` (rebuilt from its
    capture, a redundant capture, or unusable), and a masked one is `masked`, its reasons
    counted by name (`capture_incomplete`, `unresolved_parent_calls`, and the error text
    of the build or its metrics). Beside them: `rebuilt` (one row each), `redundant`
    (records that carry their own token ids), `unusable` (masked before any capture was
    read, or whose build raised or found nothing) and `unchanged` (left as they were:
    inline token ids without a rollout id, or a redundant capture that could not be
    frozen)."""

    records: int = 0
    finalized: int = 0
    rebuilt: int = 0
    redundant: int = 0
    unusable: int = 0
    unchanged: int = 0
    masked: int = 0
    masked_by_reason: dict[str, int] = field(default_factory=dict)

    def count(self, built: Mapping | None, *, kind: str) -> None:
        """Count one record whose build is `built` (None: left unchanged); `kind` is
        "rebuilt", "redundant" or "unusable"."""
        if built is None:
            self.records += 1
            self.unchanged += 1
            return
        masked = bool(built.get("mask_sample"))
        self.count_outcome(kind, masked, record_reasons(built) if masked else [])

    def count_outcome(self, kind: str, masked: bool, reasons: list[str]) -> None:
        """Count one finalized record of `kind`, masked or not, with the reasons a
        collection counts (`mask_reasons` of its build)."""
        self.records += 1
        self.finalized += 1
        setattr(self, kind, getattr(self, kind) + 1)
        if not masked:
            return
        self.masked += 1
        for reason in reasons:
            self.masked_by_reason[reason] = self.masked_by_reason.get(reason, 0) + 1

    def merge(self, other: RecordCounts) -> None:
        for name in ("records", "finalized", "rebuilt", "redundant", "unusable", "unchanged", "masked"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        reasons = Counter(self.masked_by_reason)
        reasons.update(other.masked_by_reason)
        self.masked_by_reason = dict(reasons)

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in ("records", "finalized", "rebuilt", "redundant", "unusable", "unchanged", "masked")}
        out["masked_by_reason"] = dict(sorted(self.masked_by_reason.items(), key=lambda item: (-item[1], item[0])))
        return out

    @classmethod
    def from_json(cls, raw: Any) -> RecordCounts:
        if not isinstance(raw, dict):
            raise ValueError("its record counts are not an object")
        counts = {name: raw[name] for name in ("records", "finalized", "rebuilt", "redundant", "unusable", "unchanged", "masked")}
        reasons = raw["masked_by_reason"]
        for value in [*counts.values(), *(reasons.values() if isinstance(reasons, dict) else [None])]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError("a record count is not a count")
        if not all(isinstance(key, str) for key in reasons):
            raise ValueError("a mask reason is not a string")
        return cls(**counts, masked_by_reason=dict(reasons))


# --- the parts -------------------------------------------------------------------------------

# A snapshot retirement may drop: (capture directory label, rollout id, snapshot id, version).
Snapshot = tuple[str, str, str, int]


def _snapshot(raw: Any) -> Snapshot:
    if (
        not isinstance(raw, (list, tuple)) or len(raw) != 4 or not all(isinstance(v, str) for v in raw[:3])
        or not isinstance(raw[3], int) or isinstance(raw[3], bool)
    ):
        raise ValueError(f"a redundant capture is not [directory, rollout id, snapshot id, version]: {bounded_repr(raw)}")
    return (raw[0], raw[1], raw[2], raw[3])


@dataclass(frozen=True)
class RecordsPart:
    """What a batch task reports for the records part it wrote: its name, the position
    of its first record in the results, how many records it holds, its bytes and sha256,
    and the snapshots of its redundant captures (what retirement drops for them)."""

    name: str
    first_index: int
    records: int
    file_bytes: int
    sha256: str
    redundant: tuple[Snapshot, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "first_index": self.first_index,
            "records": self.records,
            "file_bytes": self.file_bytes,
            "sha256": self.sha256,
            "redundant": [list(s) for s in self.redundant],
        }

    @classmethod
    def from_json(cls, raw: Any) -> RecordsPart:
        if not isinstance(raw, dict):
            raise ValueError("a records part is not an object")
        for key in ("first_index", "records", "file_bytes"):
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"records part {key} is not a count")
        if not isinstance(raw["sha256"], str) or not isinstance(raw["redundant"], list):
            raise ValueError("a records part's sha256 or redundant captures are malformed")
        return cls(
            raw["name"], raw["first_index"], raw["records"], raw["file_bytes"], raw["sha256"],
            tuple(_snapshot(s) for s in raw["redundant"]),
        )


@dataclass(frozen=True)
class RecordsManifest:
    """The records section of a manifest: the parts in input order, the outcome counts
    of all records, and the Arrow type of each field carried by name (`record_fields`,
    in column order)."""

    parts: tuple[RecordsPart, ...]
    counts: RecordCounts
    record_fields: dict[str, str] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return sum(p.records for p in self.parts)

    def redundant(self) -> list[Snapshot]:
        """Every redundant capture's snapshot, each once, in input order."""
        return list(dict.fromkeys(s for part in self.parts for s in part.redundant))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "jsonl",
            "records": self.records,
            "counts": self.counts.to_json(),
            "record_fields": dict(self.record_fields),
            "parts": [p.to_json() for p in self.parts],
        }

    @classmethod
    def from_json(cls, output: Path, raw: Any) -> RecordsManifest:
        """The records section of the manifest of `output`. Part names are checked here,
        like shard names: OutputError (one line) for a name that is not a plain name in
        the output's records folder, a part listed twice, or parts out of input order."""
        if not isinstance(raw, dict) or raw.get("format") != "jsonl" or not isinstance(raw["parts"], list):
            raise ValueError("its records section is not one raycap writes")
        parts = tuple(RecordsPart.from_json(p) for p in raw["parts"])
        seen: set[str] = set()
        expected = 0
        for part in parts:
            problem = records_part_name_problem(part.name)
            if problem is None and part.name in seen:
                problem = "which it lists twice"
            if problem is None and part.first_index != expected:
                problem = f"whose first record is {part.first_index} where record {expected} comes next"
            if problem is not None:
                raise OutputError(
                    f"the manifest of {output} lists records part {bounded_repr(part.name)}, {problem}; nothing of the "
                    f"output was read: a records part is a plain name inside the output ({RECORDS_DIR}/NAME.jsonl), "
                    "in input order; restore the manifest, or finalize the output again"
                )
            seen.add(part.name)
            expected += part.records
        fields = raw.get("record_fields") or {}
        if not isinstance(fields, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items()):
            raise ValueError("its record_fields are not names and types")
        return cls(parts, RecordCounts.from_json(raw["counts"]), dict(fields))


def write_records_part(
    staging_dir: str | os.PathLike | Location, index: int, lines: Iterable[bytes], *, first_index: int, records: int,
    redundant: Iterable[Snapshot] = (),
) -> RecordsPart:
    """Write a batch's finalized records (`lines`, each a JSON text without its newline)
    durably as records part `index` of the staging directory (or PUT whole into an
    object store's staging attempt), replacing an earlier attempt's part of the same
    batch; its metadata, measured while writing (`raycap.output.shards.write_staged`)."""
    lines = list(lines)
    name = records_part_name(index)

    def write(handle: BinaryIO) -> None:
        # A line and its newline in two writes: a line of a long rollout is megabytes,
        # and joining them would copy each once more.
        for line in lines:
            handle.write(line)
            handle.write(b"\n")

    file_bytes, sha256 = write_staged(staging_dir, name, write, "finalizes")
    return RecordsPart(name, first_index, records, file_bytes, sha256, tuple(redundant))
