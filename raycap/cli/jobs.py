"""Entry points a training cluster runs: `python -m jobs.<name> --config FILE`.

- `jobs.rebuild`: capture directories in, one durable Parquet dataset out, then retirement;
- `jobs.finalize`: a rollout collection's results file finalized into one durable dataset
  (rows and finalized records), then retirement;
- `jobs.clear`: delete stale captures of the rollouts about to be dispatched;
- `jobs.sweep`: remove retired tombstones older than a retention period;
- `jobs.demo`: a synthetic corpus through `jobs.rebuild`, for a first look.

Jobs are thin: they read a config (`raycap.cli.jobconfig`), call the library, print what
happened and exit with a status a scheduler can act on:

- 0: done;
- 1: the work ran but part of it failed (the reasons are on stderr); a rerun finishes it.
  A fault of the output's file system while writing (disk full, I/O error, read-only) is
  this too: one line names the path and the way out, nothing is committed or retired,
  and a rerun once it is fixed builds the rows;
- 2: the job could not start: bad config (a key given twice, a config or ids file that is
  not a regular file), missing capture directory, unwritable, locked, conflicting or
  misplaced output (inside a capture directory or another committed output, or named
  like a capture file), an output some building node cannot see, an output URI that is
  malformed, of an unknown scheme, or names a missing bucket or a store that does not
  answer (nothing is created locally), no Ray cluster to join. One line on stderr says why;
- 3: (rebuild, finalize) the masked share exceeded max_mask_fraction; the reasons are on stderr.

The same config runs locally and under `ray job submit`: with RAY_ADDRESS set (as a
submitted job has) or `ray.address` configured, a job joins that cluster and passes it no
resources; otherwise it starts an embedded Ray sized by `ray.num_cpus`. A rebuild whose
rows are built in the job's own process (`executor: local`, or `auto` on a small input
with no Ray asked for) starts no Ray at all: its directories are checked here instead.

Every job takes `--verbose`. Without it the console holds the job's own lines, the
summary and raycap's warnings (real faults: a lost task, a dead actor, naming the
rollouts); an expected mask prints nothing, because the summary, the `error` column and
`mask_reasons` are its record. With it, raycap logs at debug level: one line per masked
rollout, and each failed build's full error, from the builder tasks too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from raycap.cli.jobconfig import CaptureJobConfig, RayOptions
from raycap.rows.executor import ExecutorChoice, RayState, Request, decide, ray_running
from raycap.rows.options import RebuildOptions, checked_rollout_ids

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_MASKED = 3


def fail(prog: str, message: str, code: int = EXIT_USAGE) -> int:
    """Print the reason as one line on stderr and return the exit status."""
    print(f"{prog}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return code


def file_system_fault(prog: str, exc: OSError, output: object) -> int:
    """An OSError from the output's file system that no layer named (space, permissions,
    mounts): one line naming the file, and exit 1, since a rerun once it is fixed builds
    the rows (nothing was committed or retired)."""
    where = exc.filename or output
    return fail(
        prog,
        f"{type(exc).__name__} on {where}: {exc.strerror or exc}; fix that file system (space, permissions, "
        "mounts) and rerun: nothing was committed or retired",
        EXIT_FAILED,
    )


def outcome_status(prog: str, outcome: Any) -> int:
    """Print a handoff's summary and give its exit status (`raycap.runs.handoff.Outcome`): 0
    done, 3 rejected by the mask check, 1 when part of the retirement failed (the first
    errors on stderr; a rerun finishes it)."""
    from raycap.runs.handoff import DONE, REJECTED

    print(outcome.summary.render(), flush=True)
    if outcome.status == DONE:
        return EXIT_OK
    if outcome.status == REJECTED:
        return fail(prog, outcome.message, EXIT_MASKED)
    for error in outcome.summary.retired.errors[:10]:
        print(f"{prog}: retire: {error}", file=sys.stderr)
    return fail(prog, outcome.message, EXIT_FAILED)


@dataclass(frozen=True)
class Arguments:
    config: str | None
    verbose: bool = False
    # Config keys given on the command line ("ray.address" for a nested one), and the
    # flag of every key the job takes as one.
    overrides: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)

    @property
    def dirs_from(self) -> str:
        """Where the capture directories came from, for an error line."""
        return "the DIR arguments" if "capture_dirs" in self.overrides or not self.config else str(self.config)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}; see {self.prog} --help")


# The flags of the jobs that write one dataset (`jobs.rebuild`, `jobs.finalize`): each
# gives the config key of the same meaning, and wins over the config file's value. The
# values are passed on as given, so the config's own validation judges them.
# (flag, config key, metavar or "bool" or "list", jobs, help)
_FLAGS = (
    ("--output", "output", "OUT", "rebuild finalize", "the dataset to write: a path or s3://BUCKET/KEY"),
    ("--results", "results", "FILE", "finalize", "the collection's results file (JSONL, one record per rollout)"),
    ("--records-file", "records_file", "FILE", "finalize", "also write the finalized records as one results file"),
    ("--record-field", "record_fields", "list", "finalize", "a scalar record field to carry as a column (repeatable)"),
    ("--retire", "retire", "bool", "rebuild finalize", "retire the captures once the dataset is committed"),
    ("--overwrite", "overwrite", "bool", "rebuild finalize", "set an existing output aside and write a new one"),
    ("--executor", "executor", "E", "rebuild finalize", "where the rows are built: auto, ray or local"),
    ("--builder", "builder", "NAME", "rebuild finalize", "prefix_merging or per_request"),
    ("--delivery", "delivery", "D", "rebuild", "rollout (one row each) or chains (one row per chain)"),
    ("--model", "model", "NAME", "rebuild", "the model name the rows carry"),
    ("--rollout-ids-file", "rollout_ids_file", "FILE", "rebuild", "only these rollouts, one id a line"),
    ("--max-mask-fraction", "max_mask_fraction", "X", "rebuild finalize", "reject the output above this masked share"),
    ("--batch-size", "batch_size", "N", "rebuild finalize", "rollouts per builder task"),
    ("--max-in-flight", "max_in_flight", "N", "rebuild finalize", "builder tasks at a time"),
    ("--address", "ray.address", "ADDR", "rebuild finalize", "join the Ray cluster there (default: RAY_ADDRESS, else embedded)"),
)
from raycap.errors import (
    CannotStart,  # noqa: F401 - raised here, declared with the others
    UsageError,  # noqa: F401 - raised here, declared with the others
)

_USAGE = {
    "rebuild": "DIR... --output OUT [--retire] [--executor E]",
    "finalize": "DIR... --results FILE --output OUT [--records-file FILE] [--retire] [--executor E]",
}
_PATH_KEYS = ("output", "results", "records_file", "rollout_ids_file")


def _from_here(key: str, value: str) -> str:
    """A path given on the command line, taken from the current directory (a config's
    are taken from its own); URIs and node-qualified directories as they are."""
    from raycap.output.location import is_uri

    if is_uri(value) or (key == "capture_dirs" and ":/" in value and not value.startswith("/")):
        return value
    return os.path.abspath(os.path.expanduser(value))


def parse_arguments(prog: str, description: str, argv: Sequence[str] | None, job: str | None = None) -> Arguments:
    """The job's arguments: `--config FILE`, and for `job` ("rebuild", "finalize") the
    capture directories and the flags of `_FLAGS`, any of which may stand without a
    config. `prog` is how the job is named: "jobs.rebuild" under `python -m`, or the
    `raycap` command's "raycap rebuild". A bad argument raises UsageError."""
    shown = prog if prog.startswith("raycap") else f"python -m {prog}"
    usage = None if job is None else f"%(prog)s {_USAGE[job]} [--config FILE] [options]"
    parser = (argparse.ArgumentParser if job is None else _Parser)(prog=shown, description=description, usage=usage)
    flags: dict[str, str] = {}
    if job is None:
        parser.add_argument("--config", required=True, help="the job's YAML config (see configs/)")
    else:
        parser.add_argument("dirs", nargs="*", metavar="DIR", help="capture directories (plain paths or NODE:/path)")
        parser.add_argument("--config", metavar="FILE", help="a YAML config (see configs/); flags win over its keys")
        flags["capture_dirs"] = "DIR"
        for flag, key, kind, jobs, text in _FLAGS:
            if job not in jobs.split():
                continue
            flags[key] = flag
            if kind == "bool":
                parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=text)
            elif kind == "list":
                parser.add_argument(flag, dest=key, action="append", metavar="NAME", help=text)
            else:
                parser.add_argument(flag, dest=key, metavar=kind, help=text)
    parser.add_argument(
        "--verbose", action="store_true",
        help="log every masked rollout and each failed build's full error (default: the summary is the record)",
    )
    # Directories may come before, between or after the flags.
    args = vars(parser.parse_args(argv) if job is None else parser.parse_intermixed_args(argv))
    overrides: dict[str, Any] = {}
    if job is not None:
        if args["dirs"]:
            overrides["capture_dirs"] = [_from_here("capture_dirs", d) for d in args["dirs"]]
        for key in flags:
            value = args.get(key)
            if key != "capture_dirs" and value is not None:
                overrides[key] = _from_here(key, value) if key in _PATH_KEYS else value
        if args["config"] is None and not overrides:
            raise UsageError(f"give the capture directories and --output (or --config FILE); see {shown} --help")
    return Arguments(args["config"], args["verbose"], overrides, flags)


@contextmanager
def job_logging(verbose: bool) -> Iterator[None]:
    """raycap's log records on stderr, one `name: LEVEL: message` each, for the job's run:
    warnings and worse, or with `verbose` everything from debug up. Removed again after,
    so a job run inside another program leaves its logging as it was."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    handler.setLevel(logging.DEBUG if verbose else logging.WARNING)
    logger = logging.getLogger("raycap")
    level = logger.level
    if verbose:
        logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def runs_embedded(options: RayOptions) -> bool:
    """Whether the job will start its own Ray on this machine rather than join a cluster."""
    return not options.address and not os.environ.get("RAY_ADDRESS")


def connect_ray(options: RayOptions) -> None:
    """Join the configured cluster (or RAY_ADDRESS's) or start an embedded Ray."""
    import ray

    from raycap.cluster.rebuild.session import connect

    if ray.is_initialized():
        return
    if runs_embedded(options):
        connect(None, num_cpus=options.num_cpus)
    else:
        # A submitted job's driver must not pass resources: the cluster already has them.
        connect(options.address or "auto")


def executor_choice(config: CaptureJobConfig, executor: str, rollout_ids: Sequence[str] | None = None) -> ExecutorChoice:
    """Where the job's work runs, as `raycap.rows.executor.decide` says for this config: with
    "ray" on Ray (clear and sweep run there), with "local" here; with "auto", on Ray when
    a cluster is asked for or already connected, else as the input's size decides
    (without starting Ray)."""
    options = RebuildOptions(executor=executor, skip_retired=rollout_ids is None)
    request = Request(tuple(config.capture_dirs), checked_rollout_ids(rollout_ids), options, "rows", config.ray.address)
    # Joined already (a job that ran before this one in the process): the work runs there.
    return decide(request, RayState(running=True, warm=True) if ray_running() else RayState(running=False))


def uses_ray(config: CaptureJobConfig, executor: str, rollout_ids: Sequence[str] | None = None) -> bool:
    """Whether the job's work runs on Ray (see `executor_choice`)."""
    return executor_choice(config, executor, rollout_ids).executor == "ray"


def ensure_fleet(
    config: CaptureJobConfig, config_path: str, *, executor: str = "ray", rollout_ids: Sequence[str] | None = None
) -> None:
    """Connect and start the actors of the capture directories' nodes, or raise CannotStart;
    when the work runs in this process (see `uses_ray`), only check the directories here.

    A capture directory that does not exist, or an actor that cannot start, is reported
    here, before any work, as a job that could not start. Plain paths are checked on this
    machine first when Ray would run here, which saves starting Ray for a typo."""
    if runs_embedded(config.ray) or executor == "local":
        missing = config.missing_local_dirs()
        if missing:
            raise CannotStart(f"capture directory {missing[0]} does not exist; check capture_dirs in {config_path}")
    try:
        if not uses_ray(config, executor, rollout_ids):
            return
    except (ValueError, FileNotFoundError) as exc:
        raise CannotStart(str(exc)) from None
    from raycap.cluster.rebuild.session import session  # Ray is imported only for work that runs there

    try:
        connect_ray(config.ray)
    except ConnectionError as exc:
        raise CannotStart(f"cannot connect to Ray: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any failure to reach Ray stops the job the same way
        where = config.ray.address or os.environ.get("RAY_ADDRESS") or "an embedded Ray"
        raise CannotStart(
            f"cannot connect to {where}: {type(exc).__name__}: {exc}; start the cluster, fix ray.address, "
            "or remove ray.address to run embedded"
        ) from None
    try:
        # The session the work then runs on: its placement and actors are kept for it.
        session(config.capture_dirs, address=config.ray.address).fleet()
    except (ValueError, TimeoutError, RuntimeError) as exc:
        raise CannotStart(str(exc)) from None


def start_fleet(prog: str, config: CaptureJobConfig, config_path: str) -> int | None:
    """`ensure_fleet`, as an exit status (None when it started)."""
    try:
        ensure_fleet(config, config_path)
    except CannotStart as exc:
        return fail(prog, str(exc))
    return None
