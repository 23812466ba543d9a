"""Streaming for asynchronous training: rows as rollouts finish, delivered until committed.

- The capture directories are the queue; the stream keeps nothing they do not hold, so a
  new stream after a crash starts from exactly what they say.
- A rollout is ready when its capture is frozen, not retired, and no current commit
  marker settles it (`raycap.stream.readiness`). `submit` freezes what the caller says
  finished (ids, or Gym's result records, kept beside the capture until it is retired:
  `raycap.stream.records`); `watch=True` finds what others froze (`raycap.stream.watch`).
  A stream never freezes a rollout nobody said had finished: that would cut it.
- `take` hands out built rows, staleness masked (`raycap.stream.taking`); builds run
  ahead in the background (`raycap.stream.buildahead`).
- `commit` accepts only rows this stream delivered and no commit has claimed
  (`raycap.stream.ledger`), then, each step durable before the next: the commit markers,
  the step's dataset (with `output`), the drop of the unmasked rollouts' snapshots
  (`raycap.stream.stepcommit`). Masked rollouts stay as evidence, never delivered again.
- Recovery: a current marker whose output holds the rollout's exact snapshot is a
  finished commit; any other marker is removed and its rollout is ready again. So each
  rollout ends in exactly one committed step, and nothing is retired before its row is.
- Where the directories are served (this process, or their nodes' actors) is
  `raycap.runs.streamdirs`' choice; the rules are the same everywhere.
- One stream consumes a directory at a time (its `.raycap-stream.lock`): two consumers
  would deliver the same rollouts twice.

The rules in full: docs/streaming.md ("The stream's rules").
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from raycap.capture.recordfile import KeptRecord
from raycap.observe.figures import StreamFigures
from raycap.rows.batch import schema_of
from raycap.rows.options import RebuildOptions
from raycap.runs.streamdirs import open_directories
from raycap.stream.buildahead import BuildAhead
from raycap.stream.dirs import Hooks
from raycap.stream.readiness import READY
from raycap.stream.records import parse_submitted
from raycap.stream.stepcommit import CommitReport, StepCommit
from raycap.stream.steps import Built
from raycap.stream.taking import Taking, _is_int

logger = logging.getLogger(__name__)

DEFAULT_MAX_AHEAD_ROWS = 256
DEFAULT_MAX_AHEAD_BYTES = 256 << 20


@dataclass
class StreamStats:
    """What a stream has done since it started (rollouts unless named rows)."""

    submitted: int = 0
    discovered: int = 0
    delivered: int = 0
    rows_delivered: int = 0
    stale: int = 0
    committed: int = 0
    retired: int = 0
    kept_as_evidence: int = 0
    recovered_finished: int = 0
    recovered_ready: int = 0
    build_failures: int = 0
    # Rollouts held back because their commit marker is damaged (each logged once).
    damaged_markers: int = 0
    # Rollouts held back because their record file is damaged (each logged once).
    damaged_records: int = 0
    # Ready rollouts given up because their node was lost before they were taken: a
    # stream that sees the node again delivers them.
    lost: int = 0


@dataclass(frozen=True)
class Submitted:
    """What `submit` did: the ids now ready, and what it refused with the reason, keyed
    by the id (an id given as such) or `record <i>` (the record at position i of the
    sequence: never a valid id, which has no spaces)."""

    ready: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)


class Stream(Taking):
    """A stream of built rows over capture directories (see the module docstring).
    The keywords named like `raycap.rows.options.RebuildOptions`' fields are those
    options (see there).

    Examples:
        >>> import tempfile
        >>> import raycap
        >>> from raycap.cli.synth import CorpusSpec, generate_corpus
        >>> work = tempfile.mkdtemp()
        >>> spec = CorpusSpec(rollouts=2, turns=(4, 4), system_tokens=(8, 8), fault_share=0.0)
        >>> corpus = generate_corpus(f"{work}/captures", spec)
        >>> with raycap.Stream([f"{work}/captures"], executor="local") as stream:
        ...     submitted = stream.submit(list(corpus.rollout_ids))
        ...     rows = stream.take(2, timeout=60)
        ...     report = stream.commit(rows, output=f"{work}/steps/step-0")
        >>> rows.num_rows, report.rollouts, report.retired
        (2, 2, 2)
    """

    def __init__(
        self,
        capture_dirs: Sequence[Any],
        *,
        builder: str = "prefix_merging",
        model: str = "",
        delivery: str = "rollout",
        executor: str = "auto",
        watch: bool = False,
        version_key: str | None = None,
        max_ahead_rows: int = DEFAULT_MAX_AHEAD_ROWS,
        max_ahead_bytes: int = DEFAULT_MAX_AHEAD_BYTES,
        address: str | None = None,
    ) -> None:
        # The options are checked once, as every rebuild's are (ValueError naming the
        # known values); the directories build with the same value.
        options = RebuildOptions.of(locals())
        for name, value in (("max_ahead_rows", max_ahead_rows), ("max_ahead_bytes", max_ahead_bytes)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        self.builder, self.model, self.delivery, self.version_key = builder, model, delivery, version_key
        self.watch = watch
        self.max_ahead_rows, self.max_ahead_bytes = max_ahead_rows, max_ahead_bytes
        self.stats = StreamStats()
        self._schema = schema_of(delivery, version_key)
        self._cond = threading.Condition()
        self._ready: deque[str] = deque()
        # Every rollout this stream holds in memory: ready, being built, built, or taken
        # and not yet committed. Discovery never queues these again.
        self._known: set[str] = set()
        self._judging: set[str] = set()
        self._again: set[str] = set()
        self._built: deque[Built] = deque()
        self._building: set[str] = set()
        self._void: set[str] = set()  # forgotten while being built
        self._ahead_rows = 0
        self._ahead_bytes = 0
        self._wanted = 0
        self._warned_versions = False
        self._held: set[str] = set()  # rollouts held back, said once each
        # Whether the latest take asked for refs: builds keep rows on Ray only then, so
        # a taker of tables gets them without a second round trip to the object store.
        self._refs_wanted = False
        self._commits = 0  # commits finished; see _consider
        # Records kept by this stream's submits for rollouts not taken yet (they win over
        # what a build read), the rollouts a submit is keeping a record for right now
        # (a take waits for them), and the record each taken rollout was taken with.
        self._records: dict[str, KeptRecord] = {}
        self._attaching: set[str] = set()
        self._sealed: dict[str, KeptRecord | None] = {}
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.dirs: Any = None
        self.dirs = open_directories(
            capture_dirs, options=options, address=address, watch=watch, schema=self._schema,
        )
        self.paths = list(self.dirs.labels)
        self.figures = StreamFigures(",".join(self.paths))
        # What take() delivered, and the commits that claim it (`raycap.stream.stepcommit`).
        self._commit = StepCommit(self.dirs, self._step_inputs, delivery)
        try:
            self.dirs.start(Hooks(self._consider, self._queue, self._forget, self._count, self._held_back, self._known))
        except BaseException:
            self.close()
            raise
        self._start_thread(BuildAhead(self).run, "raycap-stream-build")

    @property
    def rebuilder(self) -> Any:
        """The `raycap.Rebuilder` that builds for a stream over local paths (None when
        the directories' nodes build)."""
        return getattr(self.dirs, "rebuilder", None)

    # -- lifecycle ----------------------------------------------------------------------------

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Stop building and watching and release the directories. Writes nothing: what
        was taken and not committed is delivered again by the next stream."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=30)
        if self.dirs is not None:
            self.dirs.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- readiness -----------------------------------------------------------------------------

    def submit(self, rollouts: Sequence[str | Mapping[str, Any]]) -> Submitted:
        """These rollouts finished: freeze them (in every directory holding them) and make
        them ready, in this order. Each is given by its id or by its finished result
        record, whose rollout id is read by Gym's rules and which is kept with the
        capture until the commit (see the module docstring). Refused with the reason,
        and never frozen: an invalid id, a record with no capture key or a malformed id,
        an id no directory holds a capture of (freezing it would make a phantom
        rollout), a retired rollout, or one already committed as masked evidence. A
        single str, bytes or Mapping is a TypeError: iterating it would submit one id
        per character, or per key."""
        given = parse_submitted(_submitted_items(rollouts))
        refused, ids, records, key_of = given.refused, given.ids, given.records, given.keys
        with self._cond:
            for rid in list(records):
                if rid in self._sealed:
                    held = self._sealed[rid]
                    if held is not None and held.data == records[rid].data:
                        del records[rid]  # taken with this very record: a no-op, as a repeated id is
                        continue
                    why = f"rollout {rid} was taken from this stream {'with another record' if held else 'without a record'}"
                elif rid in self._attaching:
                    why = f"another submit is keeping a record for rollout {rid} right now"
                else:
                    continue
                refused[key_of[rid]] = f"{why}; a rollout is delivered with one record until its commit: commit it first"
                ids.remove(rid)
                del records[rid]
            self._attaching.update(records)
        answers: dict[str, str | None] = {}
        try:
            if ids:
                answers = self.dirs.submit(ids, records)
        finally:
            with self._cond:
                for rid, kept in records.items():
                    if answers.get(rid, "") is None:
                        self._records[rid] = kept
                self._attaching.difference_update(records)
                self._cond.notify_all()
        for rid, reason in answers.items():
            if reason is not None:
                refused[key_of[rid]] = reason
        ready, queued = [], 0
        for rid in ids:
            if key_of[rid] in refused:
                continue
            verdict = self._consider(rid, None)
            if verdict is None or verdict == "queued":
                ready.append(rid)
                queued += verdict == "queued"
            else:
                refused[key_of[rid]] = verdict
        with self._cond:
            self.stats.submitted += queued
        for key, reason in refused.items():
            logger.warning("%s was submitted but is not ready: %s", key if key.startswith("record ") else f"rollout {key}", reason)
        return Submitted(tuple(ready), refused)

    def _consider(self, rid: str, outputs: dict[str, Any] | None = None) -> str | None:
        """Queue `rid` if it is ready. Returns "queued", None when it was known already,
        or why it is not ready. Where the directories judge in this process, judges it
        (finishing an interrupted commit of its snapshot); elsewhere it was judged where
        it lives before it was offered."""
        with self._cond:
            # One judge per rollout at a time: the watch and a rescan may both see it, and
            # finishing an interrupted commit twice would only log a failed second drop.
            if rid in self._known or self._closed:
                return None
            if rid in self._judging:
                # Its state changed while the judge read it (a freeze right after another
                # write): the judge reads it again before letting go, so no event is lost.
                self._again.add(rid)
                return None
            self._judging.add(rid)
        try:
            while True:
                with self._cond:
                    commits = self._commits
                    self._again.discard(rid)
                status = self.dirs.judge(rid, {} if outputs is None else outputs) if self.dirs.judges_here else READY
                if status != READY:
                    with self._cond:
                        if rid in self._again and not self._closed:
                            continue
                    return status
                with self._cond:
                    if rid in self._known or self._closed:
                        return None
                    if commits != self._commits and self.dirs.judges_here:
                        # A commit finished while the state was read: the rollout may have
                        # been queued, taken and committed meanwhile, so judge it again.
                        continue
                    self._known.add(rid)
                    self._ready.append(rid)
                    self.figures.ready([rid])
                    self._cond.notify_all()
                return "queued"
        finally:
            with self._cond:
                self._judging.discard(rid)

    def _queue(self, ids: list[str]) -> list[str]:
        """Queue rollouts judged ready where they live, in their order; the ones queued."""
        queued = []
        with self._cond:
            if self._closed:
                return []
            for rid in ids:
                if rid in self._known or rid in self._judging:
                    continue
                self._known.add(rid)
                self._ready.append(rid)
                queued.append(rid)
            self.figures.ready(queued)
            if queued:
                self._cond.notify_all()
        return queued

    def _forget(self, ids: Iterable[str]) -> None:
        """These rollouts can no longer be delivered from here (their node was lost):
        out of the queue and of what this stream holds. Taken rollouts stay taken: a
        commit of them says what it could not do (`raycap.stream.stepcommit`)."""
        gone = set(ids)
        with self._cond:
            building = gone & self._building
            drop = {rid for rid in self._ready if rid in gone} | {p.rollout_id for p in self._built if p.rollout_id in gone}
            drop |= building
            self._void |= building  # their builds, when they return, are not delivered
            self._ready = deque(rid for rid in self._ready if rid not in drop)
            kept: deque[Built] = deque()
            for piece in self._built:
                if piece.rollout_id in drop:
                    self._ahead_rows -= piece.rows
                    self._ahead_bytes -= piece.nbytes
                else:
                    kept.append(piece)
            self._built = kept
            self._known.difference_update(drop)
            self.figures.forget(drop)
            for rid in drop:
                self._records.pop(rid, None)  # kept in its directory: its build reads it again
            self.stats.lost += len(drop)
            self._cond.notify_all()

    def _count(self, stat: str, n: int = 1) -> None:
        with self._cond:
            setattr(self.stats, stat, getattr(self.stats, stat) + n)

    def _held_back(self, rid: str, why: str) -> bool:
        """Say once per rollout that it is held back, neither delivered nor retired
        until someone looks; True the first time."""
        with self._cond:
            if rid in self._held:
                return False
            self._held.add(rid)
        logger.warning("rollout %s is held back, neither delivered nor retired: %s", rid, why)
        return True

    # -- building ahead (raycap.stream.buildahead) ------------------------------------------------------

    # -- committing ----------------------------------------------------------------------------

    def commit(self, rows: pa.Table | Sequence[Any], output: str | os.PathLike | None = None) -> CommitReport:
        """Make `rows` durable, then retire the exact snapshots of the rollouts whose rows
        are all unmasked. `rows` is what take() returned, whole rollouts: a table, or the
        refs take_refs() returned. With `output`, the rows become one committed dataset
        there (one new directory per step), with the finalized records of the rollouts
        taken with a record in its `.records/` (`raycap.read_records(output)`); without,
        the caller declares them durable elsewhere (its checkpoint, which keeps the
        records `records(rows)` gave). `CommitReport.records` holds the finalized records.

        Refused before anything is written, the rows staying taken: rows this stream did
        not deliver, or changed, or committed already, or another thread is committing
        (ValueError, `raycap.stream.ledger`); an output placed where `rebuild_to_output` refuses
        one, or one that already holds other rows (`StepRefused`, a ValueError too). The
        step is written from the rows this stream delivered, never the caller's values;
        refs are written by a Ray task, never fetched into this process
        (`raycap.stream.stepcommit`)."""
        if self._closed:
            raise RuntimeError("this stream is closed; its taken rows are delivered again by the next stream")
        report, settled = self._commit.commit(rows, output)
        self.dirs.settled(settled)
        with self._cond:
            self._commits += 1
            self._known.difference_update(settled)
            for rid in settled:
                self._sealed.pop(rid, None)
            self.stats.committed += report.rollouts
            self.stats.retired += report.retired
            self.stats.kept_as_evidence += report.kept_as_evidence
            waiting = self._waiting()
        self.figures.committed(report.output, report.rollouts, report.rows, report.retired, waiting)
        return report

    def metrics(self) -> dict[str, float]:
        """This stream's figures now, as one flat dict under `raycap/` keys, for a
        trainer's logger (`wandb.log(stream.metrics(), step=step)`): see
        `raycap.observe.figures`. The same figures are `raycap_*` series where Ray runs."""
        with self._cond:
            waiting = self._waiting()
        return self.figures.as_dict(waiting)

    def _waiting(self) -> int:
        """Rollouts ready, being built or built, not taken yet (under the lock)."""
        return len(self._ready) + len(self._building) + len(self._built)

    def records(self, rows: pa.Table | Sequence[Any]) -> list[Any]:
        """The finalized records of the rollouts of `rows` (what take() returned, not yet
        committed) that were taken with a record, in their order: each what Gym's
        `finalize_rollout_token_capture` leaves in it, and what committing `rows` writes
        into a step's `.records/`. Without an output, keep them in the checkpoint that
        makes the rows durable before `commit(rows)` retires anything. Nothing is
        committed or retired; refused as a commit of `rows` would be (ValueError)."""
        if self._closed:
            raise RuntimeError("this stream is closed; its taken rows are delivered again by the next stream")
        return self._commit.records(rows)

    def _step_inputs(self, ids: list[str]) -> Any:
        """What a step dataset of `ids` records as its inputs (`raycap.output.commit.Inputs`)."""
        from raycap.output.commit import Inputs

        return Inputs(tuple(self.paths), tuple(ids), self.builder, self.model, self.delivery)



def _submitted_items(rollouts: Any) -> list[str | Mapping[str, Any]]:
    """submit()'s rollouts, checked: a collection of ids (strings) and records (Mappings)."""
    if isinstance(rollouts, (str, bytes, bytearray, Mapping)):
        raise TypeError(
            f"submit takes a list of rollout ids or records, not the single {type(rollouts).__name__} "
            f"{rollouts!r:.40}; wrap a single id in a list (and a single record too)"
        )
    if not isinstance(rollouts, Iterable):
        raise TypeError(f"submit takes a list of rollout ids or records, not {type(rollouts).__name__}")
    items = list(rollouts)
    for item in items:
        if not isinstance(item, (str, Mapping)):
            raise TypeError(
                f"{type(item).__name__} {item!r:.40} is neither a rollout id nor a record; give ids as strings and "
                "records as dicts"
            )
    return items
