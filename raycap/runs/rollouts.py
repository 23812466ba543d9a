"""Finalizing a rollout collection's results file at once: records in, one committed dataset out.

NeMo Gym finalizes each finished record on its own
(`raycap.capture.delivery.finalize_rollout_token_capture`). `finalize_rollouts` does the
same for a whole results file (or iterable of records), at cluster scale, into one
dataset in the rebuild's format and commit (`raycap.runs.handoff`): a row per record
built from its capture, with the record's columns, and every record, finalized, in
`.records/` (`raycap.output.recordparts`), which `read_records` yields in input order.

The policy is the handoff's, at a collection's order (SPEC 10.6):

1. Check the arguments; hold the output's lock.
2. One streaming pass over the results names the input and cuts batches by cost
   (`raycap.finalize.results`); reuse or refuse the output as a rebuild does.
3. The one dispatch (`raycap.runs.dispatch`) says where batches are finalized: here
   with worker processes (`raycap.finalize.pool`, `raycap.finalize.worker`) or by Ray
   tasks (`raycap.cluster.finalizer`); the driver only commits.
4. The mask check counts as a collection counts, on the whole file
   (`raycap.output.summary.records_gate`).
5. `records_file` is written durably from the committed output, before any retirement.
6. With `retire`, exactly what Gym's `capture_build_can_retire` allows is dropped,
   through the one retirement path; then the summary is written.

The policy in full: docs/finalizing.md ("The policy, step by step").
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

from raycap.capture.directory import CaptureDir, local_paths, refuse_capture_place
from raycap.capture.directory import capture_dirs as parse_capture_dirs
from raycap.capture.store import TokenCaptureStore, is_valid_rollout_id
from raycap.finalize.batch import plan_of
from raycap.finalize.recordsfile import RecordsFileDraft
from raycap.finalize.results import (
    BATCH_BYTES,
    BATCH_RECORDS,
    ResultsScan,
    check_results_start,
    open_results,
    scan_results,
    spool_records,
    write_records,
)
from raycap.finalize.results import ResultsError as ResultsError  # public here: what a bad results file raises
from raycap.finalize.results import read_records as read_records  # public here: reads what finalize_rollouts wrote
from raycap.observe.metrics import RunMeter, run_tags
from raycap.observe.timing import StageClock, take_batch_figures
from raycap.output.commit import (
    Committed,
    Inputs,
    OutputLock,
    StagedOutput,
)
from raycap.output.location import Location, as_location, check_writable, parse_location
from raycap.output.protocol import backend_of, open_output, refuse_records_file_in
from raycap.output.recordparts import RecordCounts, RecordsManifest
from raycap.output.shards import write_shard
from raycap.output.summary import Executor, RebuildSummary, Throughput, records_gate, summarize
from raycap.rows.arrow import FIELD_TYPE_NAMES, with_record_fields
from raycap.rows.batch import schema_of
from raycap.rows.executor import ExecutorChoice, Request, ray_running
from raycap.rows.local import Progress
from raycap.rows.options import MAX_CAPTURE_BYTES, RebuildOptions
from raycap.runs.dispatch import choose, finalize_batches
from raycap.runs.handoff import (
    DEFAULT_MASK_FRACTION_MIN_SAMPLES,
    Outcome,
    check_shared_staging,
    conclude,
    pause_from_env,
)

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


def _checked_records_file(target: Path | None, results: Any, dirs: Sequence[CaptureDir]) -> Path | None:
    """The records file's own checks, after the output's (`refuse_records_file_in`)."""
    if target is None:
        return None
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
    worker_stall_s: float = RebuildOptions.worker_stall_s,
) -> Outcome:
    """Finalize the records of `results` (a JSONL results file, or an iterable of record
    dicts) against the captures in `capture_dirs` into the dataset `output`: rows, and the
    finalized records in its `.records/` folder (see the module docstring for the policy
    and `read_records` to read them back). Returns the handoff's `Outcome` (DONE,
    RETIRE_INCOMPLETE, or REJECTED by the mask check); the summary counts the records by
    outcome.

    The keywords named like `raycap.rows.options.RebuildOptions`' fields are those
    options (see there); here `batch_size` counts records per task
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
    the output or a capture directory (where the kernel would put it: links resolved
    before `..`), at a file the run writes beside the output (its summary, lock, staging,
    results spool, a place it is moved aside to), at the results file, that is a folder
    or whose folder cannot be made (a file on its path); OutputError for a
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
    options = RebuildOptions.of(locals())
    fields = _checked_fields(record_fields)
    source = _checked_results(results)
    location = parse_location(output, storage_options)
    check_writable(location)
    target = None if records_file is None else Path(records_file)
    if target is not None:
        refuse_records_file_in(location, target)
    target = _checked_records_file(target, source, dirs)
    if max_mask_fraction is not None and not 0.0 <= max_mask_fraction <= 1.0:
        raise ValueError(f"max_mask_fraction must be between 0 and 1, or None, not {max_mask_fraction!r}")
    if isinstance(mask_fraction_min_samples, bool) or not isinstance(mask_fraction_min_samples, int) or mask_fraction_min_samples < 0:
        raise ValueError(f"mask_fraction_min_samples must be a count, not {mask_fraction_min_samples!r}")
    if options.executor == "local" and not local_paths(dirs).readable:
        raise ValueError(
            f"executor local reads capture directories in this process, but {local_paths(dirs).why_not}; use executor ray"
        )
    if isinstance(source, Path):
        fd = open_results(source, str(source))  # a regular file, there: checked before anything is touched
        try:
            check_results_start(fd, str(source))
        finally:
            os.close(fd)
    backend = open_output(location, dirs)
    note = log or (lambda _message: None)
    spool = backend.spool_path(location)
    with backend.lock(location) as lock:
        try:
            clock = StageClock()
            meter = RunMeter(run_tags(backend.where(location), dirs), clock, progress)
            with clock.stage("discovery"):
                scan = _scan(source, spool, options, fields, dirs)
            return _run(
                scan, dirs, location, options, fields, lock=lock, target=target, retire=retire, overwrite=overwrite,
                max_mask_fraction=max_mask_fraction, min_samples=mask_fraction_min_samples, address=address,
                progress=progress, note=note, start=start, pause=pause, meter=meter,
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
    return choose(Request(tuple(dirs), None, options, "shards", address, input_bytes))


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
    meter: RunMeter,
) -> Outcome:
    typed = tuple((name, str(scan.field_types[name])) for name in fields)
    inputs = Inputs(tuple(d.label for d in dirs), None, options.builder, "", "rollout", results=scan.sha256, record_fields=fields)
    backend = backend_of(location)
    output = backend.where(location)
    clock = meter.clock
    with clock.stage("discovery"):
        checked = backend.check_output(location, inputs, overwrite)
    reuse = checked.reuse and checked.manifest is not None and checked.manifest.records is not None
    choice = None
    if not reuse or retire:
        choice = choose_executor(dirs, options, address, scan.size)
        if choice.executor == "ray" and start is not None:
            was_running = ray_running()
            with clock.stage("ray_start"):
                start()
            if was_running:  # Ray was there already: no Ray stage
                clock.seconds.pop("ray_start", None)
    throughput = superseded = ran = draft = None
    if reuse:
        note(f"{output} already holds the finalized records of these inputs; reusing it")
        manifest = checked.manifest
    else:
        assert choice is not None
        committed, throughput, ran, draft = _build(
            scan, dirs, location, inputs, options, typed, overwrite=overwrite, address=address, progress=progress,
            pause=pause, lock=lock, choice=choice, records_file=target, meter=meter,
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
        summary.timings_s, summary.capture_bytes_read = clock.as_dict(), meter.bytes_read
        summary.mask_check = records_gate(manifest.records.counts, max_mask_fraction, min_samples)

        def accepted(summary: RebuildSummary) -> None:
            if target is not None:
                # The draft written during the run, else the file written from the output.
                if draft is None or not draft.place(manifest.records.parts):
                    write_records(target, manifest, lambda part, write: backend.stream_part(location, part, write))
                summary.records_file = str(target)

        return conclude(location, manifest, summary, dirs, retire=retire, address=address, executor=options.executor,
                        pause=pause, lock=lock, meter=meter, accepted=accepted)
    finally:
        if draft is not None:
            draft.discard()


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
    meter: RunMeter,
) -> tuple[Committed, Throughput, Executor, RecordsFileDraft | None]:
    """Finalize and commit; with `records_file`, the records file is drafted as the
    batches are reported (`raycap.finalize.recordsfile`): the caller places
    or discards the draft returned."""
    started = time.monotonic()
    take_batch_figures()  # what this process measured before this run is not its
    draft = None
    with StagedOutput(output, inputs=inputs, schema="rollout", overwrite=overwrite, lock=lock) as staged:
        staging = staged.for_tasks
        check_shared_staging(staged, choice)
        if records_file is not None:
            draft = RecordsFileDraft.begin(records_file, lambda part, write: staged.backend.stream_staged_part(staging, part, write))
        try:
            committed = _finalize_and_commit(
                staged, scan, dirs, options, fields, address, progress, pause, choice, draft, meter
            )
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
    pause: Callable[[str], None], choice: ExecutorChoice, draft: RecordsFileDraft | None, meter: RunMeter,
) -> Committed:
    """The batches of `scan` finalized into `staged` and committed (see `_build`)."""
    staging = staged.for_tasks
    forks = staged.backend.staging_written_by_forks
    batches = finalize_batches(
        choice, scan, dirs, options, fields, staging, address=address, forks=forks, keep_lines=draft is not None
    )
    state = Progress(total=scan.records)
    if progress:
        progress(state)
    shards, parts, counts = [], [], RecordCounts()
    try:
        for done in batches:
            if done.shard is not None:
                shards.append(done.shard)
                meter.shard(done.shard)
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
    committing = time.perf_counter()
    committed = staged.commit(
        shards, records=records, before_rename=lambda: pause("MID_COMMIT"),
        during_roll_forward=lambda: pause("MID_ROLL_FORWARD"),
    )
    meter.committed(time.perf_counter() - committing)
    return committed

