"""The durable handoff: capture directories in, a committed dataset out, then retirement.

`rebuild_to_output` is the whole policy, for the rebuild job and for any caller; the job
only reads its config, calls it and prints. In order:

1. Check the arguments and the output's place; hold the output's lock for the run.
2. Reuse a committed output of the same inputs (rollouts it retired cannot be rebuilt
   again), refuse one of other inputs or one that rollouts arrived after, unless
   `overwrite`. The manifest is read once, by that check.
3. Build: the one dispatch (`raycap.runs.dispatch`) says where; builder tasks, or this
   process, write shards into the staging area and the driver commits them
   (`raycap.output.commit`: local rename, or an object store's conditional write).
4. Summarise from the manifest and apply the mask gate; a failed gate retires nothing
   and sets the rows aside at `<output>.rejected`.
5. With `retire`, retire through the one retirement path (`raycap.runs.directories`),
   then write `<output>.summary.json`, with the run's seconds per stage
   (`raycap.observe.timing`). As shards arrive, their counts go to `raycap_*` metrics
   where Ray runs (`raycap.observe.metrics`).

A crash anywhere loses nothing: before the commit nothing is visible or retired; after
it, a rerun reuses the dataset and finishes the retirement. Test hooks
(`RAYCAP_JOB_PAUSE_<STAGE>`, `PAUSE_STAGES`) and the policy in full: docs/outputs.md
("The rebuild's policy, step by step").
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from raycap.capture.directory import CaptureDir, local_paths
from raycap.capture.directory import capture_dirs as parse_capture_dirs
from raycap.observe.metrics import RunMeter, run_tags
from raycap.observe.progress import stage_line
from raycap.observe.timing import StageClock, take_batch_figures
from raycap.output.commit import (
    Committed,
    Inputs,
    OutputLock,
    StagedOutput,
)
from raycap.output.faults import NoRollouts, OutputError
from raycap.output.location import Location, parse_location
from raycap.output.manifest import Manifest
from raycap.output.protocol import Backend, backend_of, open_output
from raycap.output.summary import Executor, RebuildSummary, RetireCounts, Throughput, mask_gate, summarize
from raycap.rows.executor import ExecutorChoice, Request, listed_ids, ray_running
from raycap.rows.options import MAX_CAPTURE_BYTES, RebuildOptions, checked_rollout_ids
from raycap.runs.directories import list_rollouts, retire_dirs
from raycap.runs.dispatch import executor_for

logger = logging.getLogger(__name__)

DEFAULT_MASK_FRACTION_MIN_SAMPLES = 50
PAUSE_ENV_PREFIX = "RAYCAP_JOB_PAUSE_"
# The most entries a directory may have for `nothing_here` to list it.
NOTHING_HERE_ENTRIES = 256
PAUSE_STAGES = ("AFTER_FIRST_SHARD", "AFTER_LAST_SHARD", "MID_COMMIT", "BEFORE_RETIRE", "AFTER_FIRST_RETIRED_SHARD")
# A stage only a commit to an object store passes (between MID_COMMIT and BEFORE_RETIRE).
OBJECT_STORE_STAGES = ("MID_ROLL_FORWARD",)

# What became of a run that got as far as a summary.
DONE = "done"  # committed (or reused), checked, and retired when asked
RETIRE_INCOMPLETE = "retire_incomplete"  # some snapshots could not be dropped: a rerun finishes
REJECTED = "rejected"  # the mask gate failed: nothing retired, rows moved to <output>.rejected


def pause_from_env(stage: str) -> None:
    """Sleep at `stage` when RAYCAP_JOB_PAUSE_<stage> gives seconds (a test hook)."""
    seconds = os.environ.get(PAUSE_ENV_PREFIX + stage)
    if seconds:
        logger.warning("test hook: pausing %s s at %s", seconds, stage)
        time.sleep(float(seconds))


@dataclass(frozen=True)
class Outcome:
    """How a handoff ended: its status (DONE, RETIRE_INCOMPLETE, REJECTED), the summary,
    where the rows are (the output, or `<output>.rejected`) and, unless DONE, one line
    saying what happened and the way out."""

    status: str
    summary: RebuildSummary
    rows: Path | Location
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == DONE


def rebuild_to_output(
    capture_dirs: Iterable[Any],
    output: str | os.PathLike,
    rollout_ids: Sequence[str] | None = None,
    *,
    builder: str = "prefix_merging",
    model: str = "",
    delivery: str = "rollout",
    overwrite: bool = False,
    retire: bool = False,
    max_mask_fraction: float | None = None,
    mask_fraction_min_samples: int = DEFAULT_MASK_FRACTION_MIN_SAMPLES,
    batch_size: int | None = None,
    max_in_flight: int | None = None,
    address: str | None = None,
    executor: str = "auto",
    verbose: bool = False,
    progress: Callable[[Any], None] | None = None,
    log: Callable[[str], None] | None = None,
    max_capture_bytes: int | None = MAX_CAPTURE_BYTES,
    start: Callable[[], None] | None = None,
    pause: Callable[[str], None] = pause_from_env,
    options: RebuildOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    allow_empty: bool = True,
) -> Outcome:
    """Rebuild `capture_dirs` into the dataset directory `output` durably, summarise,
    check the masked share and, with `retire`, retire what it holds (see the module
    docstring for the policy). With `allow_empty` False, a build that finds no captured
    rollout raises NoRollouts before its commit: nothing is written.

    Raises OutputError (one line, with the way out) when the run cannot start: the
    output is locked by another run, conflicts with these inputs, cannot be written, or
    rollouts arrived since it was written. `progress` gets the driver's progress and, if
    it has `finish()`, is finished when building ends (a `raycap.output.summary.ProgressLine`).
    `log` gets one-line notes (e.g. that the output is reused). `start` is called once
    before the cluster is first needed (the job connects and checks its directories
    there); without it the driver connects on first use, to `address`. The keywords
    named like `raycap.rows.options.RebuildOptions`' fields are those options (see
    there), checked before anything is touched. `options=` (a RebuildOptions replacing those keywords) is
    deprecated: pass the keywords. `output`
    is a path or a URI (`s3://BUCKET/KEY`, see `raycap.output.location`), or a Location;
    `storage_options` go to its file system (and the commit point's client).

    The arguments are checked before anything is touched (TypeError for ids given as one
    string, ValueError for repeated ids, no directory, batch_size or max_in_flight below
    1), and so is the output's place (`raycap.output.commit.check_placement`: OutputError for an
    output inside a capture directory or another committed output, or named like a
    capture file). A fault of the output's file system while the run writes (disk full,
    I/O error, read-only) raises `raycap.output.faults.OutputWriteError`: nothing is
    committed or retired.

    Examples:
        >>> import tempfile
        >>> import raycap
        >>> from raycap.cli.synth import CorpusSpec, generate_corpus
        >>> work = tempfile.mkdtemp()
        >>> spec = CorpusSpec(rollouts=3, turns=(4, 4), system_tokens=(8, 8), fault_share=0.0)
        >>> corpus = generate_corpus(f"{work}/captures", spec)
        >>> output = f"{work}/trajectories/step-1"
        >>> outcome = raycap.rebuild_to_output([f"{work}/captures"], output, model="m", retire=True, executor="local")
        >>> outcome.status, raycap.read_manifest(output).totals.rows, outcome.summary.retired.dropped
        ('done', 3, 3)
    """
    ids = checked_rollout_ids(rollout_ids)
    dirs = parse_capture_dirs(capture_dirs)
    if options is None:
        options = RebuildOptions.of(locals())
    else:
        keywords = ", ".join(f"{name}=" for name in _option_keywords(rebuild_to_output))
        warnings.warn(
            "rebuild_to_output(options=RebuildOptions(...)) is deprecated: pass the options as keywords "
            f"({keywords})",
            DeprecationWarning,
            stacklevel=2,
        )
    # Listing a directory again after an earlier run retired part of it: the consumed
    # rollouts are not this run's work.
    options = dataclasses.replace(options, skip_retired=ids is None)
    executor, verbose = options.executor, options.verbose
    location = parse_location(output, storage_options)
    backend = open_output(location, dirs)
    output = backend.where(location)
    inputs = Inputs(tuple(d.label for d in dirs), ids, options.builder, options.model, options.delivery)
    note = log or (lambda _message: None)
    clock = StageClock()
    meter = RunMeter(run_tags(output, dirs), clock, progress)
    with backend.lock(location) as lock:
        # The manifest is read once per run, by the check: the arrived check, the
        # summary and retirement use it.
        with clock.stage("discovery"):
            checked = backend.check_output(location, inputs, overwrite)
        reuse = checked.reuse
        if not reuse and not allow_empty and nothing_here(dirs, ids, options, address):
            # What the build would refuse after its Ray started: refused before it starts.
            raise NoRollouts(_no_rollouts(dirs))
        joining = not ray_running() and Request(dirs, ids, options, "shards", address).cluster_asked
        if (not reuse or retire or ids is None) and start is not None:
            was_running = ray_running()
            with clock.stage("ray_start"):
                start()
            if was_running or not ray_running():  # Ray was there already, or nothing started it: no Ray stage
                clock.seconds.pop("ray_start", None)
            elif joining and not reuse and not allow_empty and nothing_here(dirs, ids, options, address):
                # Joined to a cluster of this one node: refused before any actor lists it.
                raise NoRollouts(_no_rollouts(dirs))
        manifest = checked.manifest if reuse else None
        if manifest is not None and ids is None:
            with clock.stage("discovery"):
                arrived = _arrived_since(backend, location, manifest, dirs, address, options)
            if arrived and not overwrite:
                raise OutputError(
                    f"{output} was built from these directories before {len(arrived)} more rollouts arrived "
                    f"(e.g. {arrived[0]}); write them to a new output, or set overwrite: true to rebuild all"
                )
            reuse = not arrived

        throughput = superseded = ran = None
        if reuse and manifest is not None:
            note(f"{output} already holds the rows of these inputs; reusing it")
        else:
            committed, throughput, ran = _build(
                dirs, location, inputs, options, overwrite=overwrite, address=address, progress=progress, pause=pause,
                lock=lock, allow_empty=allow_empty, meter=meter,
            )
            manifest = committed.manifest
            superseded = committed.superseded
            if superseded is not None:
                note(f"the previous {output} was moved to {superseded}")
            if verbose:
                _log_masked(backend, location, manifest)

        summary = summarize(
            manifest, reused=reuse, throughput=throughput, superseded=None if superseded is None else str(superseded),
            executor=ran,
        )
        summary.timings_s = clock.as_dict()
        summary.capture_bytes_read = meter.bytes_read
        summary.mask_check = mask_gate(summary, max_mask_fraction, mask_fraction_min_samples)
        return conclude(location, manifest, summary, dirs, retire=retire, address=address, executor=executor,
                        pause=pause, lock=lock, meter=meter)


def _option_keywords(function: Callable[..., Any]) -> list[str]:
    """The `RebuildOptions` fields `function` takes as keywords, in its signature's order."""
    fields = {f.name for f in dataclasses.fields(RebuildOptions)}
    return [name for name in inspect.signature(function).parameters if name in fields]


def conclude(
    location: Location,
    manifest: Manifest,
    summary: RebuildSummary,
    dirs: tuple[CaptureDir, ...],
    *,
    retire: bool,
    address: str | None,
    executor: str,
    pause: Callable[[str], None],
    lock: OutputLock,
    meter: RunMeter,
    accepted: Callable[[RebuildSummary], None] | None = None,
) -> Outcome:
    """The protocol's last steps once an output is committed (or reused) and summarised,
    the same for every writer: a failed mask check sets the output aside and retires
    nothing (`reject`); else `accepted` runs, then with `retire` retirement (which
    verifies every committed part first), and the summary is written beside the output."""
    backend = backend_of(location)
    output = backend.where(location)
    if summary.mask_check is not None and not summary.mask_check.passed:
        return reject(location, summary, retire)
    if accepted is not None:
        accepted(summary)
    if retire:
        pause("BEFORE_RETIRE")
        started = time.perf_counter()
        summary.retired = retire_committed(location, manifest, dirs, address, executor, pause, lock)
        summary.timings_s["retire"] = round(time.perf_counter() - started, 3)
        meter.retired(summary.retired.dropped, len(summary.retired.errors))
    backend.write_summary(location, summary.to_json())
    if summary.retired is not None and summary.retired.errors:
        return Outcome(
            RETIRE_INCOMPLETE,
            summary,
            output,
            f"{len(summary.retired.errors)} snapshots could not be retired; their captures are kept, "
            "rerun to finish",
        )
    return Outcome(DONE, summary, output)


def reject(location: Location, summary: RebuildSummary, retire: bool) -> Outcome:
    """Set a dataset that failed the mask check aside (a consumer watching the output
    path must never train on it), then write its summary there.

    The summary is written after the move so that it can name where the rows of any
    earlier retirement now are: when captures were retired from this output or from
    one set aside before it, those rows are the only copy of their rollouts, and
    "captures are kept" would be untrue."""
    backend = backend_of(location)
    kept = backend.set_aside(location)
    holders = backend.retired_outputs(location)
    check = summary.mask_check.message
    if holders:
        where = ", ".join(str(path) for path in holders)
        note = f"captures were retired earlier from rows kept at {where}: those rows are their only copy, keep them"
        if retire:
            summary.retire_skipped = f"the mask check failed; {note}"
        message = f"mask check {check}; nothing more was retired; {note}; the rows of this run are at {kept}"
    else:
        if retire:
            summary.retire_skipped = "the mask check failed; captures are kept for a rerun"
        message = (
            f"mask check {check}; nothing was retired, the rows are kept at {kept}; "
            "fix the captures (or max_mask_fraction) and rerun"
        )
    backend.write_summary(location.sibling(kept.name), summary.to_json())
    return Outcome(REJECTED, summary, kept, message)


def _log_masked(backend: Backend, location: Location, manifest: Manifest) -> None:
    """Each masked row of the committed dataset, with its reasons and full error, at debug level."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    import pyarrow.compute as pc

    for shard in backend.shards(location, manifest):
        columns = ["rollout_id", "mask_sample", "mask_reasons", "error"] + (["chain_id"] if manifest.schema == "chains" else [])
        table = backend.read_table(shard, columns)
        for row in table.filter(pc.fill_null(table.column("mask_sample"), True)).to_pylist():
            chain = f" chain {row['chain_id']}" if row.get("chain_id") is not None else ""
            reasons = ", ".join(row["mask_reasons"] or []) or "no reason recorded"
            detail = f": {row['error']}" if row["error"] else ""
            logger.debug("rollout %s%s masked (%s)%s", row["rollout_id"], chain, reasons, detail)


def _arrived_since(
    backend: Backend, location: Location, manifest: Manifest, dirs: tuple[CaptureDir, ...], address: str | None, options: RebuildOptions
) -> list[str]:
    """Rollouts the directories list (retired ones aside) that the output does not hold."""
    listed = list_rollouts(dirs, skip_retired=True, address=address, executor=options.executor)
    held: set[str] = set()
    for shard in backend.shards(location, manifest):
        held.update(backend.read_table(shard, ["rollout_id"]).column("rollout_id").to_pylist())
    return sorted(set(listed) - held)


def _no_rollouts(dirs: tuple[CaptureDir, ...]) -> str:
    return f"no captured rollouts in {', '.join(d.label for d in dirs)}: nothing was built or written"


def nothing_here(dirs: tuple[CaptureDir, ...], ids: tuple[str, ...] | None, options: RebuildOptions, address: str | None) -> bool:
    """Whether a listing build on Ray finds no rollout to build, known from this machine
    alone: where it is the whole cluster (no cluster asked for, so an embedded Ray would
    start here; or the Ray this process joined, or would join, has one node, this one)
    and every directory is a plain path here, the listing here is the one the node's
    actor would make. Asked only of `executor="ray"` (`auto` starts Ray only for more
    captures than build here, and a build here lists for itself), and only of
    directories of at most NOTHING_HERE_ENTRIES entries: a larger one is not listed twice."""
    if ids is not None or options.executor != "ray":
        return False
    local = local_paths(dirs)
    if not local.readable or not all(_few_entries(path) for path in local.paths):
        return False
    if listed_ids(local.paths, options.skip_retired):
        return False
    # The cluster's nodes are asked last, and only of directories that list nothing.
    if ray_running():
        return _one_node_here()
    if Request(dirs, None, options, "shards", address).cluster_asked:
        from raycap.cluster.plumbing.connect import lone_node_here  # not joined yet: its GCS is asked

        return lone_node_here(address)
    return True


def _one_node_here() -> bool:
    import ray  # running already: asked only then

    alive = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    return alive == [ray.get_runtime_context().get_node_id()]


def _few_entries(path: str) -> bool:
    with os.scandir(path) as entries:
        return sum(1 for _ in itertools.islice(entries, NOTHING_HERE_ENTRIES + 1)) <= NOTHING_HERE_ENTRIES


def check_shared_staging(staged: StagedOutput, choice: ExecutorChoice) -> None:
    """Every node that may build must see the staging directory (only asked of a
    running Ray: a run in this process writes where it reads). An object store's
    staging needs no such check: every node writes to the store itself."""
    if choice.executor == "local" or not ray_running() or not staged.backend.staging_needs_shared_fs:
        return
    from raycap.cluster.rebuild.shared_output import check_shared_output

    check_shared_output(str(staged.for_tasks))


def _build(
    dirs: tuple[CaptureDir, ...],
    output: Location,
    inputs: Inputs,
    options: RebuildOptions,
    *,
    overwrite: bool,
    address: str | None,
    progress: Callable[[Any], None] | None,
    pause: Callable[[str], None],
    lock: OutputLock,
    meter: RunMeter,
    allow_empty: bool = True,
) -> tuple[Committed, Throughput, Executor]:
    started = time.monotonic()
    take_batch_figures()  # what this process measured before this run is not its
    with StagedOutput(output, inputs=inputs, schema=inputs.delivery, overwrite=overwrite, lock=lock) as staged:
        ids = checked_rollout_ids(inputs.rollout_ids)
        # One dispatch: a run built here never loads the Ray session, nor Ray.
        building, choice = executor_for(Request(dirs, ids, options, "shards", address))
        check_shared_staging(staged, choice)
        run = building.run(ids, options, progress=progress, shard_dir=staged.for_tasks, choice=choice)
        for result in run:
            meter.shard(result)
            if len(run.results) == 1:
                pause("AFTER_FIRST_SHARD")
        if not allow_empty and not any(shard.rows for shard in run.results):
            # Raised inside the staged output: its staging is removed, nothing is committed.
            raise NoRollouts(_no_rollouts(dirs))
        finish = getattr(progress, "finish", None)
        if finish is not None:
            finish()
        pause("AFTER_LAST_SHARD")
        committing = time.perf_counter()
        committed = staged.commit(
            run.results, before_rename=lambda: pause("MID_COMMIT"), during_roll_forward=lambda: pause("MID_ROLL_FORWARD")
        )
        meter.committed(time.perf_counter() - committing)
    seconds = max(time.monotonic() - started, 1e-9)
    manifest = committed.manifest
    throughput = Throughput(
        round(seconds, 3),
        round(manifest.totals.rollouts / seconds, 2),
        round(manifest.arrow_bytes / 1e6 / seconds, 2),
    )
    return committed, throughput, Executor(run.choice.executor, run.choice.reason)


def retire_committed(
    location: Location,
    manifest: Manifest,
    dirs: tuple[CaptureDir, ...],
    address: str | None,
    executor: str,
    pause: Callable[[str], None],
    lock: OutputLock,
) -> RetireCounts:
    """Drop what the committed dataset's rows allow, through the one retirement path
    (`raycap.retire`), which marks the dataset first and records how it ended. Without
    Ray running here, a retirement this process does itself never loads Ray (most of a
    second of a fresh process's time)."""
    retired_shards: list[str] = []
    shown = stage_line("retire", len(manifest.shards), "shards")

    def on_shard(shard: str, _report: Any) -> None:
        retired_shards.append(shard)
        if shown is not None:
            shown[1].done = len(retired_shards)
            shown[0](shown[1])
        if len(retired_shards) == 1:
            pause("AFTER_FIRST_RETIRED_SHARD")

    report = retire_dirs(dirs, location, address=address, on_shard=on_shard, executor=executor, manifest=manifest, lock=lock)
    if shown is not None:
        shown[0].finish()
    return RetireCounts(report.dropped, len(report.changed), list(report.errors))
