"""The output's side of retirement: which committed rows may be dropped, and the marker.

Only committed rows can be retired from: dropping first could lose a capture whose
trajectory was never written. `retiring` holds the output's lock, finishes an object
store's roll-forward, checks every part the commit wrote is there with its size and
sha256 (`raycap.output.protocol.verify`) and writes the `.retire.json` marker
("started") before it hands over a `RetiringOutput`: nothing is dropped from an output
that lost or changed a part, whose rows may be the only copy. `RetiringOutput.ended`
records how the drops ended.

A shard's retirable rows (`raycap.rows.arrow.retirable`) name their directory by
label, their snapshot id and version. Shards are opened without following a link
(`Backend.open_part`): retirement never reads another output's rows. An output of
finalized records also lists the redundant captures of records that carry their own
token ids; `RetiringOutput.listed` gives each snapshot once, however many records named
its rollout. Dropping the snapshots is the caller's (`raycap.runs.retirement`).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from raycap.output.location import Location, as_location, check_writable
from raycap.output.manifest import mark_retiring
from raycap.output.protocol import Backend, backend_of, checked_lock, verify
from raycap.output.recordparts import RECORDS_DIR
from raycap.rows.arrow import RETIRE_COLUMNS, retirable

if TYPE_CHECKING:
    from raycap.output.commit import OutputLock
    from raycap.output.manifest import Manifest

# Directory label -> [(rollout id, snapshot id, version)]: what one step drops.
PerDir = dict[str, list[tuple[str, str, int]]]
# (name, PerDir) for each step of an output of finalized records.
Listed = list[tuple[str, PerDir]]


@dataclass
class RetireReport:
    """What `retire` did: parts dropped, rollouts changed since their build, errors."""

    dropped: int = 0
    changed: list[str] = field(default_factory=list)  # snapshot changed since the build: kept
    errors: list[str] = field(default_factory=list)

    def merge(self, other: "RetireReport") -> None:
        self.dropped += other.dropped
        self.changed.extend(other.changed)
        self.errors.extend(other.errors)


def _as_given(path: str) -> str:
    return path


class RetiringOutput:
    """A committed output, checked and marked "started": its shards as a task takes them,
    the snapshots each allows dropping, and the marker's last word (`ended`)."""

    def __init__(self, location: Location, backend: Backend, manifest: Manifest, shards: list[Any]) -> None:
        self._location, self._backend, self.manifest, self.shards = location, backend, manifest, shards
        self.where = backend.where(location)

    @property
    def records(self) -> bool:
        """Whether the output holds finalized records (its snapshots are `listed`)."""
        return self.manifest.records is not None

    def retirable(self, shard: str | Location, local_path: Callable[[str], str] = _as_given) -> list[tuple[str, str, str, int]]:
        """The retirable snapshots of one committed shard, as a task holds it
        (`Backend.for_tasks`), opened where this node sees it (`local_path`)."""
        backend = self._backend
        return retirable(backend.read_table(backend.from_tasks(shard, local_path), RETIRE_COLUMNS))

    def by_dir(self, shard: str | Location, local_path: Callable[[str], str] = _as_given) -> PerDir:
        """`retirable`, by directory label."""
        per_dir: PerDir = defaultdict(list)
        for label, rid, sid, version in self.retirable(shard, local_path):
            per_dir[label].append((rid, sid, version))
        return per_dir

    def listed(self, local_path: Callable[[str], str] = _as_given) -> Listed:
        """What retirement drops from an output of finalized records, each snapshot once:
        shard by shard, the snapshots its rows allow, then the redundant captures its
        manifest lists. A rollout id given by several records appears in several shards,
        or among both; its snapshot is dropped once, by the first step that lists it."""
        steps = [(str(shard), self.retirable(shard, local_path)) for shard in self.shards]
        steps += [(f"{self.where}/{RECORDS_DIR}", self.manifest.records.redundant())]
        return once_each(steps)

    def ended(self, report: RetireReport) -> None:
        """Record in the marker how the drops ended ("incomplete" when any failed)."""
        mark_retiring(
            self._location,
            "incomplete" if report.errors else "finished",
            dropped=report.dropped,
            changed=len(report.changed),
            errors=len(report.errors),
        )


def once_each(steps: Sequence[tuple[str, Sequence[tuple[str, str, str, int]]]]) -> Listed:
    """Each step's snapshots by directory, a snapshot kept only by the first step that names it."""
    seen: set[tuple[str, str, str, int]] = set()
    listed: Listed = []
    for name, snapshots in steps:
        per_dir: PerDir = defaultdict(list)
        for snapshot in snapshots:
            if snapshot not in seen:
                seen.add(snapshot)
                per_dir[snapshot[0]].append(snapshot[1:])
        listed += [(name, dict(per_dir))]
    return listed


@contextmanager
def retiring(output: Any, *, manifest: Manifest | None = None, lock: OutputLock | None = None) -> Iterator[RetiringOutput]:
    """Check the committed `output` and mark it "started", holding its lock throughout
    (`lock` when the caller holds it already: the lock is not re-entrant). A staging
    directory, a set-aside or superseded copy, a copied dataset, or one missing or
    changing a part raises OutputError, and nothing is marked."""
    location = as_location(output)  # parsed once, here
    check_writable(location)  # retirement writes its marker into the output
    backend = backend_of(location)
    if lock is not None:
        checked_lock(location, lock)
    with nullcontext() if lock is not None else backend.lock(location):
        manifest = backend.committed_manifest(location, manifest)
        backend.finish(location, manifest)
        # Every shard is checked (inside the output, a regular file, in place) before
        # the marker. A shard travels to a task as the backend hands it over.
        committed = backend.shards(location, manifest)
        # And every part the commit wrote is there, whole, before anything is dropped.
        verify(location, manifest, committed)
        retired = RetiringOutput(location, backend, manifest, [backend.for_tasks(path) for path in committed])
        mark_retiring(location, "started", fingerprint=manifest.fingerprint)
        yield retired
