"""A stream's commit: what was delivered is claimed, marked, written and retired.

`StepCommit.commit` runs the commit of `raycap.stream` (whose docstring states the
order and the recovery), each step durable before the next:

0. the claim and the checks, before anything is written: the rows must be rows the
   stream delivered, unchanged and whole, claimed by no other commit (`raycap.ledger`);
   the step output must be placed as `rebuild_to_output` requires
   (`raycap.output.check_placement`) and hold nothing yet, or exactly this commit's
   snapshots (a retried commit: `raycap.steps.check_step`). A refusal leaves no marker,
   retires nothing, and the rows stay taken.
1. a commit marker per rollout (`mark`), from the delivered verdicts;
2. with an output, the delivered rows as one committed step dataset (`write`);
3. the exact snapshots of the unmasked rollouts are dropped (`retire`, `drop`).

A commit that fails returns its claim, so its rows can be committed again.

It imports Ray only to write a step of rows left on Ray, in a Ray task.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raycap.ledger import Claim, Ledger
from raycap.location import Location
from raycap.outputerrors import OutputError
from raycap.steps import SnapshotPart, StepRefused, check_step, ray_task, write_step
from raycap.store import CommitMarker, TokenCaptureStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitReport:
    """What `commit` made durable and retired."""

    output: Path | None
    rollouts: int
    rows: int
    retired: int
    kept_as_evidence: int
    # Rollouts whose rows were not committed because their capture changed since they
    # were taken (deleted or dropped outside the stream), with the reason.
    skipped: dict[str, str] = field(default_factory=dict)


class StepCommit:
    """The commits of one stream over `stores` (see the module docstring). `inputs`
    gives the `raycap.output.Inputs` a step of these ids records; `io` overlaps the
    fsyncs of a step's markers and drops."""

    def __init__(self, stores: dict[str, TokenCaptureStore], inputs: Callable[[list[str]], Any],
                 io: ThreadPoolExecutor) -> None:
        self.stores = stores
        self.ledger = Ledger()
        self._inputs = inputs
        self._io = io

    def commit(self, rows: Any, output: str | os.PathLike | None) -> tuple[CommitReport, list[str]]:
        """Commit `rows` (see the module docstring); the report, and every rollout the
        commit settled (the skipped ones included)."""
        out = self.step_output(output)
        claim = self.ledger.claim(rows, out)
        try:
            if out is not None:
                check_step(out, claim.snapshots(claim.ids))
            skipped = self.mark(claim, out)
            kept = [rid for rid in claim.ids if rid not in skipped]
            if out is not None and kept:
                self.write(claim, out, kept)
                self.ledger.wrote(kept, out)
            retired = self.retire([rid for rid in kept if not claim.masked(rid)], claim)
        except BaseException:
            self.ledger.release(claim)
            raise
        self.ledger.settle(claim)
        report = CommitReport(
            output=out,
            rollouts=len(kept),
            rows=sum(claim.rollouts[rid].rows.num_rows for rid in kept),
            retired=retired,
            kept_as_evidence=sum(1 for rid in kept if claim.masked(rid)),
            skipped=skipped,
        )
        return report, claim.ids

    def step_output(self, output: Any) -> Path | Location | None:
        """The step output as an absolute path, or a Location on an object store (a URI
        or a `raycap.location.Location`), placed as `rebuild_to_output` requires
        (`raycap.output.check_placement`); StepRefused otherwise."""
        if output is None:
            return None
        if not isinstance(output, (str, os.PathLike, Location)):
            raise TypeError(f"output must be a path or URI (str or os.PathLike), a Location, or None, not {type(output).__name__}")
        from raycap.location import check_writable, parse_location
        from raycap.output import check_placement

        try:
            location = parse_location(output)
            check_writable(location)
            out: Path | Location = Path(location.fs_path) if location.local else location
            check_placement(out, list(self.stores))
        except OutputError as exc:
            raise StepRefused(f"{exc}; nothing was committed") from None
        return out

    def mark(self, claim: Claim, out: Path | Location | None) -> dict[str, str]:
        """Step 1: a durable commit marker per rollout; returns the rollouts whose
        capture changed since they were taken, which are left out of the commit."""
        def write(rid: str) -> bool:
            parts = claim.rollouts[rid].parts
            if not parts:
                return False
            masked, reason = claim.verdicts[rid]
            marker = CommitMarker(parts[0].snapshot_id, parts[0].version, None if out is None else str(out), masked, reason)
            return self.stores[parts[0].label].write_commit(rid, marker)

        skipped = {}
        for rid, written in zip(claim.ids, self._io.map(write, claim.ids)):
            if not written:
                parts = claim.rollouts[rid].parts
                where = f"in {parts[0].label} is no longer snapshot {parts[0].snapshot_id}" if parts else "names no snapshot"
                skipped[rid] = (
                    f"rollout {rid} {where} (deleted or dropped outside this stream since it was taken); its rows "
                    "were not committed"
                )
                logger.warning("%s", skipped[rid])
        return skipped

    def write(self, claim: Claim, out: Path | Location, ids: list[str]) -> None:
        """Step 2: the delivered rows of `ids` as one committed dataset at `out`; rows
        left on Ray are written there, by a Ray task (an object store's step output goes
        to it as its Location, its file system's settings with it)."""
        here, refs = claim.sources(ids)
        tables = [] if here is None else [here]
        target = out if isinstance(out, Location) else str(out)
        if not refs:
            write_step(self._inputs(ids), target, ids, claim.snapshots(ids), *tables)
            return
        import ray

        ray.get(ray_task("write_step").remote(self._inputs(ids), target, ids, claim.snapshots(ids), *tables, *refs))

    def retire(self, ids: list[str], claim: Claim) -> int:
        """Step 3: drop the exact snapshots of these committed, unmasked rollouts."""
        return sum(self._io.map(lambda rid: self.drop(rid, claim.rollouts[rid].parts), ids))

    def drop(self, rid: str, parts: list[SnapshotPart]) -> bool:
        """Drop exactly these snapshot parts of `rid`; False when one is no longer there."""
        # The first part last: its directory holds the marker, which must outlive the
        # other parts' drops so that a crash between them is finished by the next stream.
        ok = True
        for part in [*parts[1:], *parts[:1]]:
            if not self.stores[part.label].drop_now(rid, snapshot_id=part.snapshot_id, version=part.version):
                ok = False
                logger.warning(
                    "rollout %s in %s is no longer snapshot %s; it was not dropped", rid, part.label, part.snapshot_id
                )
        return ok
