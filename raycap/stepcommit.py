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
3. the exact snapshots of the unmasked rollouts are dropped (`retire`).

The markers and drops are the stream's directories' work (`raycap.streamdirs`), each
step's in one batch, wherever the directories are. A commit that fails returns its
claim, so its rows can be committed again. Where a directory cannot be reached (its
node was lost), the commit says so rather than claim it: a rollout whose marker could
not be written is left out of the step, not committed (`CommitReport.skipped`), and is
delivered again by a stream that sees its directory again; a committed rollout whose
drop could not be made is reported in `CommitReport.not_retired`, and a stream that sees
its directory again finishes its retirement (its marker says it was committed).

It imports Ray only to write a step of rows left on Ray, in a Ray task.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raycap.commits import CommitMarker
from raycap.ledger import Claim, Ledger
from raycap.outputerrors import OutputError
from raycap.steps import StepRefused, check_step, ray_task, write_step

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


class StepCommit:
    """The commits of one stream over `dirs` (its `raycap.streamdirs.Directories`; see
    the module docstring). `inputs` gives the `raycap.output.Inputs` a step of these ids
    records."""

    def __init__(self, dirs: Any, inputs: Callable[[list[str]], Any]) -> None:
        self.dirs = dirs
        self.real_dirs = bool(dirs.real_dirs)
        self.ledger = Ledger(real_dirs=self.real_dirs)
        self._inputs = inputs

    def commit(self, rows: Any, output: str | os.PathLike | None) -> tuple[CommitReport, list[str]]:
        """Commit `rows` (see the module docstring); the report, and every rollout the
        commit settled (the skipped ones included)."""
        out = self.step_output(output)
        claim = self.ledger.claim(rows, out)
        try:
            if out is not None:
                check_step(out, claim.snapshots(claim.ids), real_dirs=self.real_dirs)
            skipped = self.mark(claim, out)
            kept = [rid for rid in claim.ids if rid not in skipped]
            if out is not None and kept:
                self.write(claim, out, kept)
                self.ledger.wrote(kept, out)
            retired, not_retired = self.retire([rid for rid in kept if not claim.masked(rid)], claim)
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
            not_retired=not_retired,
        )
        return report, claim.ids

    def step_output(self, output: str | os.PathLike | None) -> Path | None:
        """The step output as an absolute path, placed as `rebuild_to_output` requires
        (`raycap.output.check_placement`); StepRefused otherwise."""
        if output is None:
            return None
        if not isinstance(output, (str, os.PathLike)):
            raise TypeError(f"output must be a path (str or os.PathLike) or None, not {type(output).__name__}")
        out = Path(os.path.abspath(os.fspath(output)))
        try:
            self.dirs.check_output(out)
        except OutputError as exc:
            raise StepRefused(f"{exc}; nothing was committed") from None
        return out

    def mark(self, claim: Claim, out: Path | None) -> dict[str, str]:
        """Step 1: a durable commit marker per rollout; returns the rollouts whose
        capture changed since they were taken, which are left out of the commit."""
        items, written = [], {}
        for rid in claim.ids:
            parts = claim.rollouts[rid].parts
            if not parts:
                written[rid] = False
                continue
            masked, reason = claim.rollouts[rid].verdict
            marker = CommitMarker(parts[0].snapshot_id, parts[0].version, None if out is None else str(out), masked, reason)
            items.append((rid, parts[0], marker))
        written.update(zip([rid for rid, _, _ in items], self.dirs.mark(items)))
        skipped = {}
        for rid in claim.ids:
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

    def write(self, claim: Claim, out: Path, ids: list[str]) -> None:
        """Step 2: the delivered rows of `ids` as one committed dataset at `out`; rows
        left on Ray are written there, by a Ray task."""
        here, refs = claim.sources(ids)
        tables = [] if here is None else [here]
        snapshots = claim.snapshots(ids)
        if not refs:
            write_step(self._inputs(ids), str(out), ids, snapshots, self.real_dirs, *tables)
            return
        import ray

        ray.get(ray_task("write_step").remote(self._inputs(ids), str(out), ids, snapshots, self.real_dirs, *tables, *refs))

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
