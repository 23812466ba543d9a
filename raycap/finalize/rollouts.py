"""Finalizing a rollout collection's results file at once: records in, one committed dataset out.

NeMo Gym finalizes each finished rollout record on its own
(`raycap.capture.delivery.finalize_rollout_token_capture`): the rebuilt, token-bearing output
replaces the served one, `mask_sample` and the capture metrics are set, and the
snapshot is retired once the record is durable. `finalize_rollouts` does the same for a
whole results file (or iterable of records), at cluster scale, and writes what it made
as one dataset in the rebuild job's format and commit (`raycap.output.handoff`):

- the rows, one per record that was built from its capture (masked ones included), with
  the record's columns (`reward`, `task_index`, `rollout_index`, `attempt_index`,
  `agent_name`, `record_index`, and the fields asked for by name: `raycap.rows.arrow`);
- every record, finalized, in the hidden folder `.records/` (`raycap.output.recordparts`),
  which `read_records` yields in input order. Records that carry their own token ids,
  and records whose capture is unusable, get no row but are there, as Gym leaves them.

The policy is the handoff's, in the order a rollout collection keeps (SPEC 10.6) at
dataset scale:

1. The arguments are checked before anything is touched, then the output's lock is
   held for the whole run.
2. One streaming pass over the results (`raycap.finalize.results.scan_results`: its sha256,
   record count and batches; an iterable is written to a spool file beside the output
   first) names the input. Batches are cut by what they cost, the records' bytes and
   their captures' (a stat of each rollout's files in the directories this process
   sees, `capture_cost`), so a small results file over long rollouts still spreads
   over every CPU. The output is reused when it holds these inputs (capture
   directories, results digest, builder, record fields), refused when it holds others
   unless `overwrite`, as a rebuild's is.
3. Where the work runs is `raycap.rows.executor.decide`'s answer, the results' bytes counted
   with the captures'. Each batch of lines is finalized by one task on Ray (its bytes
   shipped through the object store, a bounded number in flight:
   `raycap.cluster.finalizer`) or in this process, by the same code
   (`raycap.finalize.batch`); locally, a large input is finalized by a few worker
   processes as well as this one, one per usable CPU (`raycap.finalize.worker`, forks of
   this process when that is safe), and on a Ray of one node this process finalizes
   batches beside forks of it, or actors where forking is not safe; each writes a batch
   while it computes the next (`raycap.finalize.pool`). Tasks and workers
   write their records part and shard into the staging directory, and the driver only
   commits (manifest, rename). The driver never holds the records: only the batches'
   byte ranges, and the reports of the batches in flight.
4. The mask check counts as a collection counts (`raycap.output.summary.records_gate`:
   masked / finalized records, once `mask_fraction_min_samples` were finalized), on the
   whole file: a collection judges after each record while it runs, but a finished
   file's verdict must not depend on the order of its lines. A failed check retires
   nothing and sets the output aside at `<output>.rejected`.
5. `records_file` is written (durably: temp file, fsync, rename) from the committed
   output, before any retirement.
6. With `retire`, exactly the snapshots Gym's `capture_build_can_retire` allows are
   dropped (unmasked rebuilt records, and redundant captures of records with their own
   token ids), from the committed output alone (its rows and its manifest), each once,
   through `raycap.retire`: never before the commit.
7. The summary (`<output>.summary.json`) counts the records by outcome.

The output may be a URI (`s3://...`, with optional `storage_options`): the commit is then
the object store's (`raycap.output.objectstore`), as a rebuild's is, tasks writing their parts
and shards straight to the store, and an iterable's spool file lives in a local
temporary directory.

A crash before the commit leaves nothing visible and nothing retired; a rerun builds the
same records (freezing is idempotent). After it, a rerun with the same inputs reuses the
output, writes `records_file` again and finishes the retirement. The test pause hooks
are the handoff's (`RAYCAP_JOB_PAUSE_<STAGE>`): AFTER_FIRST_SHARD (the first batch's
part and shard written), AFTER_LAST_SHARD, MID_COMMIT, BEFORE_RETIRE and
AFTER_FIRST_RETIRED_SHARD.

This module does not import Ray; the Ray path is loaded when a run needs it.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from raycap.capture.directory import CaptureDir, local_paths, refuse_capture_place
from raycap.capture.directory import capture_dirs as parse_capture_dirs
from raycap.capture.store import TokenCaptureStore, is_valid_rollout_id
from raycap.finalize.batch import FinalizedBatch, plan_of
from raycap.finalize.pool import finalize_pooled, here_context, local_finalizer
from raycap.finalize.recordsfile import RecordsFileDraft
from raycap.finalize.results import (
    BATCH_BYTES,
    BATCH_RECORDS,
    ResultsScan,
    open_results,
    scan_results,
    spool_records,
    write_records,
)
from raycap.finalize.results import ResultsError as ResultsError  # public here: what a bad results file raises
from raycap.finalize.results import read_records as read_records  # public here: reads what finalize_rollouts wrote
from raycap.finalize.worker import worker_processes
from raycap.finalize.worker import workers as pool_workers
from raycap.output.commit import (
    Committed,
    Inputs,
    OutputLock,
    StagedOutput,
)
from raycap.output.handoff import (
    DEFAULT_MASK_FRACTION_MIN_SAMPLES,
    Outcome,
    check_shared_staging,
    conclude,
    open_output,
    pause_from_env,
)
from raycap.output.location import Location, as_location, check_writable, parse_location
from raycap.output.protocol import backend_of
from raycap.output.recordparts import RecordCounts, RecordsManifest
from raycap.output.shards import write_shard
from raycap.output.summary import Executor, RebuildSummary, Throughput, records_gate, summarize
from raycap.rows.arrow import FIELD_TYPE_NAMES, with_record_fields
from raycap.rows.batch import schema_of
from raycap.rows.executor import ExecutorChoice, RayState, Request, decide, decide_without_ray
from raycap.rows.local import Progress
from raycap.rows.options import MAX_CAPTURE_BYTES, RebuildOptions

__all__ = ["finalize_rollouts", "read_records"]

ITERABLE_LABEL = "the records iterable"


def _checked_fields(record_fields: Iterable[str] | None) -> tuple[str, ...]:
    if record_fields is None:
        return ()
    if isinstance(record_fields, (str, bytes)):
        raise TypeError(f"record_fields must be a list of field names, not the single string {record_fields!r:.40}")
    fields = tuple(record_fields)
    taken = set(schema_of("rollout").names)
    for name in fields:
        if not isinstance(name, str) or not name:
            raise ValueError(f"record_fields must name record fields (non-empty strings), not {name!r:.40}")
        if name in taken:
            raise ValueError(f"record_fields names {name!r}, which is a column of every row already; leave it out")
    repeated = sorted(name for name, count in Counter(fields).items() if count > 1)
    if repeated:
        raise ValueError(f"record_fields names {', '.join(repeated)} more than once; give each field once")
    return fields


def _checked_results(results: Any) -> Path | Iterable[Any]:
    if isinstance(results, (str, os.PathLike)):
        return Path(results)
    if isinstance(results, (Mapping, bytes, bytearray)) or not isinstance(results, Iterable):
        raise TypeError(
            f"results must be a results file (a path) or an iterable of records, not a {type(results).__name__}; "
            "wrap a single record in a list"
        )
    return results


def _checked_records_file(records_file: Any, location: Location, results: Any, dirs: Sequence[CaptureDir]) -> Path | None:
    if records_file is None:
        return None
    target = Path(records_file)
    backend = backend_of(location)
    if backend.holds(location, target):
        raise ValueError(
            f"records_file {target} is inside the output {backend.where(location)}, whose readers would take it for "
            "theirs; write it elsewhere"
        )
    if isinstance(results, Path) and os.path.realpath(target) == os.path.realpath(results):
        raise ValueError(
            f"records_file {target} is the results file this run reads; write it elsewhere (a rerun must read the "
            "same results)"
        )
    # Every directory, a `NODE:/path` too: on one machine its path is this one's.
    refuse_capture_place(target, dirs, "records_file")
    if target.is_dir():
        raise ValueError(f"records_file {target} is a folder; name the file to write, e.g. {target / 'finalized.jsonl'}")
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # the nearest folder there is: the rest is made when the file is written
    if not folder.is_dir():
        raise ValueError(f"records_file {target} cannot be written: {folder} is not a folder; choose another records_file")
    return target


def spool_path(output: str | os.PathLike | Location) -> Path:
    """Where the records of an iterable are written before they are read as a results
    file: beside a local output, in a local temporary directory for an object store's."""
    location = as_location(output)
    return backend_of(location).spool_path(location)


def finalize_rollouts(
    capture_dirs: Iterable[Any],
    results: str | os.PathLike | Iterable[Any],
    output: str | os.PathLike,
    *,
    retire: bool = False,
    builder: str = "prefix_merging",
    record_fields: Iterable[str] | None = None,
    records_file: str | os.PathLike | None = None,
    max_mask_fraction: float | None = None,
    mask_fraction_min_samples: int = DEFAULT_MASK_FRACTION_MIN_SAMPLES,
    overwrite: bool = False,
    executor: str = "auto",
    address: str | None = None,
    batch_size: int | None = None,
    max_in_flight: int | None = None,
    max_capture_bytes: int | None = MAX_CAPTURE_BYTES,
    verbose: bool = False,
    progress: Callable[[Any], None] | None = None,
    log: Callable[[str], None] | None = None,
    start: Callable[[], None] | None = None,
    pause: Callable[[str], None] = pause_from_env,
    storage_options: Mapping[str, Any] | None = None,
) -> Outcome:
    """Finalize the records of `results` (a JSONL results file, or an iterable of record
    dicts) against the captures in `capture_dirs` into the dataset `output`: rows, and the
    finalized records in its `.records/` folder (see the module docstring for the policy
    and `read_records` to read them back). Returns the handoff's `Outcome` (DONE,
    RETIRE_INCOMPLETE, or REJECTED by the mask check); the summary counts the records by
    outcome.

    Options (`builder`, `max_in_flight`, `executor`, `max_capture_bytes`, `verbose`):
    see `raycap.rows.options.RebuildOptions`; here `batch_size` counts records per task
    (default 128, and at most 16 MiB of them and their captures), and each record's model is its
    `response.model`. `record_fields` names further scalar fields carried to the rows,
    one Arrow type each across the output; `records_file` also writes the finalized
    records as one results file there. `address`, `progress`, `log`, `start` and `pause`
    are as for `raycap.rebuild_to_output` (`start` is called once before Ray is first
    needed). `output` is a path, a URI (`s3://...`) or
    a `raycap.output.location.Location`; `storage_options` go to its file system.

    The arguments are checked before anything is touched: TypeError for results that
    are neither a path nor an iterable of records, or record_fields given as one string;
    ValueError for an unknown builder or executor, a bound below 1, record_fields that
    repeat or name a row column, a max_mask_fraction outside 0..1, a records_file inside
    the output or a capture directory, at the results file, that is a folder or whose
    folder cannot be made (a file on its path); OutputError for a
    misplaced output. A results file that is not a regular file, a line that is not JSON
    or fields of one name with two types raise `raycap.finalize.results.ResultsError` naming the
    file and record: nothing is committed or retired.

    Examples:
        >>> import tempfile
        >>> import raycap
        >>> work = tempfile.mkdtemp()
        >>> store = raycap.TokenCaptureStore(f"{work}/captures")
        >>> store.append(raycap.TokenEntry(
        ...     rollout_id="3-0", model_call_id="call-1", prompt_token_ids=[1, 2, 3],
        ...     generation_token_ids=[4, 5], generation_log_probs=[-0.1, -0.2], token_item_index=0,
        ...     output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}],
        ... ))
        >>> records = [{"_ng_task_index": 3, "_ng_rollout_index": 0, "reward": 1.0, "response": {"model": "p", "output": []}}]
        >>> outcome = raycap.finalize_rollouts([f"{work}/captures"], records, f"{work}/finalized", executor="local")
        >>> outcome.status, outcome.summary.records.finalized
        ('done', 1)
        >>> [record["response"]["output"][0]["generation_token_ids"] for record in raycap.read_records(f"{work}/finalized")]
        [[4, 5]]
    """
    dirs = parse_capture_dirs(capture_dirs)
    options = RebuildOptions(
        builder=builder, batch_size=batch_size, max_in_flight=max_in_flight, verbose=verbose, executor=executor,
        max_capture_bytes=max_capture_bytes,
    )
    fields = _checked_fields(record_fields)
    source = _checked_results(results)
    location = parse_location(output, storage_options)
    check_writable(location)
    target = _checked_records_file(records_file, location, source, dirs)
    if max_mask_fraction is not None and not 0.0 <= max_mask_fraction <= 1.0:
        raise ValueError(f"max_mask_fraction must be between 0 and 1, or None, not {max_mask_fraction!r}")
    if isinstance(mask_fraction_min_samples, bool) or not isinstance(mask_fraction_min_samples, int) or mask_fraction_min_samples < 0:
        raise ValueError(f"mask_fraction_min_samples must be a count, not {mask_fraction_min_samples!r}")
    if options.executor == "local" and not local_paths(dirs).readable:
        raise ValueError(
            f"executor local reads capture directories in this process, but {local_paths(dirs).why_not}; use executor ray"
        )
    if isinstance(source, Path):
        os.close(open_results(source, str(source)))  # a regular file, there: checked before anything is touched
    backend = open_output(location, dirs)
    note = log or (lambda _message: None)
    spool = backend.spool_path(location)
    with backend.lock(location) as lock:
        try:
            scan = _scan(source, spool, options, fields, dirs)
            return _run(
                scan, dirs, location, options, fields, lock=lock, target=target, retire=retire, overwrite=overwrite,
                max_mask_fraction=max_mask_fraction, min_samples=mask_fraction_min_samples, address=address,
                progress=progress, note=note, start=start, pause=pause,
            )
        finally:
            spool.unlink(missing_ok=True)


class LocalCaptureCost:
    """A record's captures, by a stat of its rollout's files in the capture directories
    this process sees (`TokenCaptureStore.held`: a few stats per id, no listing).
    Directories on a node (`NODE:/path`) are not counted: their records cost their
    bytes alone."""

    def __init__(self, paths: Sequence[str]):
        self.stores = [TokenCaptureStore(path, create=False) for path in paths]

    def rollout_id(self, record: Any) -> str | None:
        plan = plan_of(record)
        return plan.rollout_id if plan.error is None else None

    def capture_bytes(self, rollout_ids: list[str | None]) -> list[int]:
        valid = [r for r in dict.fromkeys(rollout_ids) if r is not None and is_valid_rollout_id(r)]
        sizes: dict[str, int] = {}
        for store in self.stores:
            try:
                held = store.held(valid)
            except (OSError, ValueError):
                continue  # a cost only: the tasks report a directory they cannot read
            for rollout_id, size in held.items():
                sizes[rollout_id] = sizes.get(rollout_id, 0) + size
        return [sizes.get(r, 0) if r is not None else 0 for r in rollout_ids]


def capture_cost(dirs: Sequence[CaptureDir]) -> LocalCaptureCost | None:
    """How a batch counts its records' captures: by a stat of the directories this
    process sees; None when it sees none (the records' bytes alone)."""
    paths = [d.path for d in dirs if d.node is None and os.path.isdir(d.path)]
    return LocalCaptureCost(paths) if paths else None


def _scan(
    source: Path | Iterable[Any], spool: Path, options: RebuildOptions, fields: tuple[str, ...], dirs: Sequence[CaptureDir]
) -> ResultsScan:
    """One pass over the results; an iterable is spooled to a file first. Batches are
    cut by what they cost: their records' bytes and their captures' (`capture_cost`)."""
    label = str(source) if isinstance(source, Path) else ITERABLE_LABEL
    if not isinstance(source, Path):
        spool_records(source, spool, label)
    return scan_results(
        source if isinstance(source, Path) else spool, label=label,
        batch_records=options.batch_size or BATCH_RECORDS, batch_bytes=BATCH_BYTES, record_fields=fields,
        cost=capture_cost(dirs),
    )


def choose_executor(dirs: Sequence[CaptureDir], options: RebuildOptions, address: str | None, input_bytes: int) -> ExecutorChoice:
    """`raycap.rows.executor.decide` for finalizing: the results' bytes count with the captures'."""
    request = Request(tuple(dirs), None, options, "shards", address, input_bytes)
    choice = decide_without_ray(request)
    if choice is not None:
        return choice
    if options.executor != "auto":
        return decide(request, RayState(running=True))  # asked for: the session is not needed to decide
    from raycap.cluster.session import session

    return decide(request, session(dirs, address=address).ray_state())


def _run(
    scan: ResultsScan,
    dirs: tuple[CaptureDir, ...],
    location: Location,
    options: RebuildOptions,
    fields: tuple[str, ...],
    *,
    lock: OutputLock,
    target: Path | None,
    retire: bool,
    overwrite: bool,
    max_mask_fraction: float | None,
    min_samples: int,
    address: str | None,
    progress: Callable[[Any], None] | None,
    note: Callable[[str], None],
    start: Callable[[], None] | None,
    pause: Callable[[str], None],
) -> Outcome:
    typed = tuple((name, str(scan.field_types[name])) for name in fields)
    inputs = Inputs(tuple(d.label for d in dirs), None, options.builder, "", "rollout", results=scan.sha256, record_fields=fields)
    backend = backend_of(location)
    output = backend.where(location)
    checked = backend.check_output(location, inputs, overwrite)
    reuse = checked.reuse and checked.manifest is not None and checked.manifest.records is not None
    choice = None
    if not reuse or retire:
        choice = choose_executor(dirs, options, address, scan.size)
        if choice.executor == "ray" and start is not None:
            start()
    throughput = superseded = ran = draft = None
    if reuse:
        note(f"{output} already holds the finalized records of these inputs; reusing it")
        manifest = checked.manifest
    else:
        assert choice is not None
        committed, throughput, ran, draft = _build(
            scan, dirs, location, inputs, options, typed, overwrite=overwrite, address=address, progress=progress,
            pause=pause, lock=lock, choice=choice, records_file=target,
        )
        manifest, superseded = committed.manifest, committed.superseded
        if superseded is not None:
            note(f"the previous {output} was moved to {superseded}")
    try:
        assert manifest is not None and manifest.records is not None
        summary = summarize(
            manifest, reused=reuse, throughput=throughput, superseded=None if superseded is None else str(superseded),
            executor=ran,
        )
        summary.mask_check = records_gate(manifest.records.counts, max_mask_fraction, min_samples)

        def accepted(summary: RebuildSummary) -> None:
            if target is not None:
                # The draft written during the run, else the file written from the output.
                if draft is None or not draft.place(manifest.records.parts):
                    write_records(target, manifest, lambda part, write: backend.stream_part(location, part, write))
                summary.records_file = str(target)

        return conclude(location, manifest, summary, dirs, retire=retire, address=address, executor=options.executor,
                        pause=pause, lock=lock, accepted=accepted)
    finally:
        if draft is not None:
            draft.discard()


def _finalize_here(
    scan: ResultsScan, dirs: Sequence[CaptureDir], options: RebuildOptions, fields: tuple[tuple[str, str], ...], staging: Any,
    count: int, forks: bool, keep_lines: bool = False,
) -> Iterator[FinalizedBatch]:
    """Each batch of `scan`, finalized in this process as a task would, each written while
    the next is computed, with `count` worker processes finalizing batches too
    (`raycap.finalize.pool`; forks of this process where `forks` and it is safe). (Its
    freezes are not made ahead on a thread: a thread waiting on fsyncs behind a busy
    interpreter waits for the interpreter lock after each, which costs more than it
    overlaps.) With `keep_lines`, this process's reports keep their lines for the records
    file's draft."""
    context = here_context(dirs, scan.label, options, fields, staging)
    start = worker_processes(count, context, scan.label, forks) if count else list
    return finalize_pooled(scan, start, local_finalizer(context, keep_lines))


def _build(
    scan: ResultsScan,
    dirs: tuple[CaptureDir, ...],
    output: Location,
    inputs: Inputs,
    options: RebuildOptions,
    fields: tuple[tuple[str, str], ...],
    *,
    overwrite: bool,
    address: str | None,
    progress: Callable[[Any], None] | None,
    pause: Callable[[str], None],
    lock: OutputLock,
    choice: ExecutorChoice,
    records_file: Path | None = None,
) -> tuple[Committed, Throughput, Executor, RecordsFileDraft | None]:
    """Finalize and commit; with `records_file`, the records file is drafted as the
    batches are reported (`raycap.finalize.recordsfile`): the caller places
    or discards the draft returned."""
    started = time.monotonic()
    draft = None
    with StagedOutput(output, inputs=inputs, schema="rollout", overwrite=overwrite, lock=lock) as staged:
        staging = staged.for_tasks
        check_shared_staging(staged, choice)
        if records_file is not None:
            draft = RecordsFileDraft.begin(records_file, lambda part, write: staged.backend.stream_staged_part(staging, part, write))
        try:
            committed = _finalize_and_commit(staged, scan, dirs, options, fields, address, progress, pause, choice, draft)
        except BaseException:
            if draft is not None:
                draft.discard()
            raise
    seconds = max(time.monotonic() - started, 1e-9)
    manifest = committed.manifest
    throughput = Throughput(round(seconds, 3), round(scan.records / seconds, 2), round(manifest.arrow_bytes / 1e6 / seconds, 2))
    return committed, throughput, Executor(choice.executor, choice.reason), draft


def _finalize_and_commit(
    staged: StagedOutput, scan: ResultsScan, dirs: tuple[CaptureDir, ...], options: RebuildOptions,
    fields: tuple[tuple[str, str], ...], address: str | None, progress: Callable[[Any], None] | None,
    pause: Callable[[str], None], choice: ExecutorChoice, draft: RecordsFileDraft | None,
) -> Committed:
    """The batches of `scan` finalized into `staged` and committed (see `_build`)."""
    staging = staged.for_tasks
    if choice.executor == "local":
        forks = staged.backend.staging_written_by_forks
        batches = _finalize_here(scan, dirs, options, fields, staging, pool_workers(scan, forks), forks, draft is not None)
    else:
        from raycap.cluster.finalizer import finalize_on_ray

        forks = staged.backend.staging_written_by_forks
        batches = finalize_on_ray(
            scan, dirs, options, fields, staging, address=address, forks=forks, keep_lines=draft is not None
        )
    state = Progress(total=scan.records)
    if progress:
        progress(state)
    shards, parts, counts = [], [], RecordCounts()
    try:
        for done in batches:
            if done.shard is not None:
                shards.append(done.shard)
            parts.append(done.part)
            if draft is not None:
                draft.add(done.part, done.lines)
            counts.merge(done.counts)
            state.done += done.part.records
            if progress:
                progress(state)
            if len(parts) == 1:
                pause("AFTER_FIRST_SHARD")
    finally:
        # A run that stops here stops its work too (tasks in flight are cancelled,
        # the freeze ahead is waited for) before its staging directory goes.
        batches.close()
    finish = getattr(progress, "finish", None)
    if finish is not None:
        finish()
    pause("AFTER_LAST_SHARD")
    if not shards:
        # No record was built: the rows still have their schema, record fields included.
        types = {name: FIELD_TYPE_NAMES[kind] for name, kind in fields}
        empty = with_record_fields(schema_of("rollout").empty_table(), types, {name: [] for name in types})
        shards.append(write_shard(staging, 0, empty))
    records = RecordsManifest(tuple(parts), counts, dict(fields))
    if draft is not None:
        draft.settle()  # every part read from the staging directory before it becomes the output
    return staged.commit(
        shards, records=records, before_rename=lambda: pause("MID_COMMIT"),
        during_roll_forward=lambda: pause("MID_ROLL_FORWARD"),
    )

