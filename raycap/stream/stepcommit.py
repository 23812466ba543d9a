"""A stream's step commit: what was delivered is claimed, marked, written and retired.

`StepCommit.commit` runs `raycap.Stream.commit`, each step durable before the next:

0. the claim and the checks, before anything is written: rows this stream delivered,
   unchanged and whole, claimed by no other commit (`raycap.stream.ledger`); a step
   output placed as `rebuild_to_output` requires, new or holding exactly this commit's
   snapshots (`raycap.stream.steps.check_step`). A refusal writes nothing;
1. a commit marker per rollout (`mark`), from the delivered verdicts;
2. with an output, the rows as one committed step dataset (`write`), the finalized
   records of rollouts taken with one in its `.records/` part;
3. the exact snapshots of the unmasked rollouts are dropped (`retire`).

The records are finalized before the markers (`raycap.stream.records.finalize`) and kept
until the commit finishes, so a retried commit writes the same ones. A commit that fails
returns its claim. A rollout whose marker cannot be written (its node lost) is left out
(`CommitReport.skipped`) and delivered again later; one whose drop fails is reported in
`CommitReport.not_retired` and retired by a stream that sees its directory again.

It imports Ray only to write a step of rows left on Ray, in a Ray task. The rules in
full: docs/internals.md ("A stream's step commit").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raycap.capture.markers import CommitMarker
from raycap.capture.records import loads_line
from raycap.output.faults import OutputError
from raycap.output.location import Location
from raycap.output.protocol import backend_of
from raycap.stream.ledger import Claim, Ledger
from raycap.stream.records import Finalized, finalize_rows, record_counts, record_lines, row_values, with_records
from raycap.stream.steps import StepRefused, check_step, ray_task, split_by_rollout, write_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitReport:
    """What `commit` made durable and retired."""

    output: Path | None
    rollouts: int
    rows: int
    retired: int
    kept_as_evidence: int
    # Rollouts whose rows were not committed, with the reason: their capture changed
    # since they were taken (deleted or dropped outside the stream), or their marker
    # could not be written (their node was lost).
    skipped: dict[str, str] = field(default_factory=dict)
    # Committed rollouts that are not retired yet, with the reason (their node was lost):
    # a stream that sees their directory again finishes the retirement.
    not_retired: dict[str, str] = field(default_factory=dict)
    # The finalized records of the committed rollouts taken with a record, in the order
    # of the commit (the step's `.records/`, which `raycap.read_records(step)` yields).
    records: tuple[Any, ...] = ()


class StepCommit:
    """The commits of one stream over `dirs` (its `Directories`: `raycap.stream.dirs.LocalDirectories`, or `raycap.cluster.streaming.driver_dirs.NodeDirectories`; see
    the module docstring). `inputs` gives the `raycap.output.commit.Inputs` a step of these ids
    records."""

    def __init__(self, dirs: Any, inputs: Callable[[list[str]], Any], delivery: str = "rollout") -> None:
        self.dirs = dirs
        self.real_dirs = bool(dirs.real_dirs)
        self.ledger = Ledger(real_dirs=self.real_dirs)
        self._inputs = inputs
        self.delivery = delivery
        # Finalized records of taken rollouts, with their lines, until their commit
        # finishes; only the commit that holds a rollout's claim touches its entry.
        self._finalized: dict[str, tuple[Finalized, bytes]] = {}

    def commit(self, rows: Any, output: str | os.PathLike | None) -> tuple[CommitReport, list[str]]:
        """Commit `rows` (see the module docstring); the report, and every rollout the
        commit settled (the skipped ones included)."""
        location = self.step_output(output)
        out = None if location is None else backend_of(location).where(location)  # as people and the markers name it
        claim = self.ledger.claim(rows, out)
        try:
            if location is not None:
                check_step(location, claim.snapshots(claim.ids), real_dirs=self.real_dirs)
            unfinished = self.finalize(claim)
            skipped = self.mark(claim, out, unfinished)
            kept = [rid for rid in claim.ids if rid not in skipped]
            records = [self._finalized[rid] for rid in kept if rid in self._finalized]
            if location is not None and kept:
                self.write(claim, location, kept, records)
                self.ledger.wrote(kept, out)
            retired, not_retired = self.retire([rid for rid in kept if not claim.masked(rid)], claim)
        except BaseException:
            self.ledger.release(claim)
            raise
        self.ledger.settle(claim)
        for rid in claim.ids:
            self._finalized.pop(rid, None)
        report = CommitReport(
            output=out,
            rollouts=len(kept),
            rows=sum(claim.rollouts[rid].rows.num_rows for rid in kept),
            retired=retired,
            kept_as_evidence=sum(1 for rid in kept if claim.masked(rid)),
            skipped=skipped,
            not_retired=not_retired,
            records=tuple(f.record for f, _ in records),
        )
        return report, claim.ids

    def records(self, rows: Any) -> list[Any]:
        """The finalized records of the rollouts of `rows` (rows take() returned, not
        committed yet) taken with a record, in their order, each a copy of what their
        commit writes. Refused as a commit of `rows` is (`raycap.stream.ledger`); nothing is
        committed."""
        claim = self.ledger.claim(rows, None, written=False)
        try:
            unfinished = self.finalize(claim)
        finally:
            self.ledger.release(claim)
        if unfinished:
            raise ValueError(next(iter(unfinished.values())))
        return [loads_line(self._finalized[rid][1]) for rid in claim.ids if rid in self._finalized]

    def finalize(self, claim: Claim) -> dict[str, str]:
        """Finalize the records the claimed rollouts were taken with (see the module
        docstring), keeping each; the rollouts whose record could not be, with why."""
        todo = {rid: d.record for rid, d in claim.rollouts.items() if d.record is not None and rid not in self._finalized}
        if not todo:
            return {}
        unfinished: dict[str, str] = {}
        if self.delivery == "chains":
            done = self._finalize_single(todo, claim, unfinished)
        else:
            here = {rid: kept for rid, kept in todo.items() if claim.rollouts[rid].whole}
            there = {rid: kept for rid, kept in todo.items() if not claim.rollouts[rid].whole}
            done = []
            if here:
                table, _ = claim.sources(list(here))
                done += finalize_rows(here, table)
            if there:
                import ray

                _, refs = claim.sources(list(there))
                done += ray.get(ray_task("finalize_rows").remote(there, *refs))
        for finalized, line in zip(done, record_lines(done)):
            self._finalized[finalized.rollout_id] = (finalized, line)
        return unfinished

    def _finalize_single(self, todo: dict[str, Any], claim: Claim, unfinished: dict[str, str]) -> list[Finalized]:
        """Chain delivery: finalize from a single-response build of each rollout's
        snapshot, which must be the one taken."""
        rows = dict(split_by_rollout(self.dirs.single_rows(list(todo))))
        done = []
        for rid, kept in todo.items():
            row = rows.get(rid)
            taken = {(p.label, p.snapshot_id, p.version) for p in claim.rollouts[rid].parts}
            found = set() if row is None else {
                (s["capture_dir"], s["snapshot_id"], s["version"]) for s in row.column("snapshots")[0].as_py() or []
            }
            if not taken or found != taken:
                unfinished[rid] = (
                    f"the record of rollout {rid} could not be finalized: its capture is no longer the snapshot it "
                    "was taken from (deleted, dropped or changed outside this stream); it was not committed"
                )
                continue
            row = with_records(row, [row.num_rows], [row_values(kept)])
            done += finalize_rows({rid: kept}, row)
        return done

    def step_output(self, output: Any) -> Location | None:
        """The step output, parsed once, named by its absolute place (an absolute path, or
        a Location on an object store: a URI or a `raycap.output.location.Location`),
        placed as `rebuild_to_output` requires (`raycap.output.commit.check_placement`);
        StepRefused otherwise."""
        if output is None:
            return None
        if not isinstance(output, (str, os.PathLike, Location)):
            raise TypeError(f"output must be a path or URI (str or os.PathLike), a Location, or None, not {type(output).__name__}")
        from raycap.output.location import check_writable, parse_location

        try:
            location = parse_location(output)
            check_writable(location)
            location = backend_of(location).resolved(location)
            self.dirs.check_output(location)
        except OutputError as exc:
            raise StepRefused(f"{exc}; nothing was committed") from None
        return location

    def mark(self, claim: Claim, out: Path | Location | None, unfinished: dict[str, str]) -> dict[str, str]:
        """Step 1: a durable commit marker per rollout; returns the rollouts whose
        capture changed since they were taken (and those of `unfinished`), which are
        left out of the commit."""
        items, written = [], {}
        for rid in claim.ids:
            parts = claim.rollouts[rid].parts
            if rid in unfinished:
                continue
            if not parts:
                written[rid] = False
                continue
            masked, reason = claim.rollouts[rid].verdict
            marker = CommitMarker(parts[0].snapshot_id, parts[0].version, None if out is None else str(out), masked, reason)
            items.append((rid, parts[0], marker))
        written.update(zip([rid for rid, _, _ in items], self.dirs.mark(items)))
        skipped = {}
        for rid in claim.ids:
            if rid in unfinished:
                skipped[rid] = unfinished[rid]
                logger.warning("%s", skipped[rid])
                continue
            outcome = written[rid]
            if outcome is True:
                continue
            parts = claim.rollouts[rid].parts
            if isinstance(outcome, str):
                skipped[rid] = (
                    f"the commit marker of rollout {rid} could not be written in {parts[0].label} ({outcome}); its rows "
                    "were not committed, and a stream that sees that directory again delivers it again"
                )
            else:
                where = f"in {parts[0].label} is no longer snapshot {parts[0].snapshot_id}" if parts else "names no snapshot"
                skipped[rid] = (
                    f"rollout {rid} {where} (deleted or dropped outside this stream since it was taken); its rows "
                    "were not committed"
                )
            logger.warning("%s", skipped[rid])
        return skipped

    def write(self, claim: Claim, out: Location, ids: list[str], records: list[tuple[Finalized, bytes]]) -> None:
        """Step 2: the delivered rows of `ids` as one committed dataset at `out`, with
        the finalized `records` of its rollouts taken with one; rows left on Ray are
        written there, by a Ray task (an object store's step output goes to it as its
        Location, its file system's settings with it)."""
        here, refs = claim.sources(ids)
        tables = [] if here is None else [here]
        snapshots = claim.snapshots(ids)
        target = out
        lines = (([line for _, line in records], record_counts([f for f, _ in records])) if records else None)
        if not refs:
            write_step(self._inputs(ids), target, ids, snapshots, self.real_dirs, *tables, records=lines)
            return
        import ray

        ray.get(ray_task("write_step").remote(
            self._inputs(ids), target, ids, snapshots, self.real_dirs, *tables, *refs, records=lines,
        ))

    def retire(self, ids: list[str], claim: Claim) -> tuple[int, dict[str, str]]:
        """Step 3: drop the exact snapshots of these committed, unmasked rollouts. How
        many were retired, and the ones whose drop could not be made, with why."""
        outcomes = self.dirs.drop([(rid, claim.rollouts[rid].parts) for rid in ids]) if ids else []
        not_retired = {}
        for rid, outcome in zip(ids, outcomes):
            if isinstance(outcome, str):
                not_retired[rid] = (
                    f"rollout {rid} is committed but not retired ({outcome}); a stream that sees its directory again "
                    "finishes the retirement"
                )
                logger.warning("%s", not_retired[rid])
        return sum(1 for outcome in outcomes if outcome is True), not_retired
