"""The jobs a training cluster runs: `raycap <name>` (or `python -m jobs.<name>` from a checkout).

- `rebuild`: capture directories in, one durable Parquet dataset out, then retirement;
- `finalize`: a results file finalized into one durable dataset, then retirement;
- `clear`: delete stale captures of the rollouts about to be dispatched;
- `sweep`: remove retired tombstones older than a retention period;
- `demo`: a synthetic corpus through `rebuild`, for a first look.

Jobs are thin: they read a config (`raycap.cli.jobconfig`) or flags, call the library,
print what happened and exit with a status from `EXIT_STATUSES`, the one table of them
(docs/jobs-and-cli.md). A refusal (status 2 or 4) leaves nothing behind. Every job
takes `-q/--quiet`, `-v/--verbose` and `--json`, through `Console`. The same config runs
locally and under `ray job submit`; a rebuild built in the job's own process starts no
Ray at all.

The long form: docs/internals.md ("The jobs").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from raycap.cli.jobconfig import CaptureJobConfig, RayOptions
from raycap.observe.progress import job_console
from raycap.rows.executor import ExecutorChoice, RayState, Request, decide, ray_running
from raycap.rows.options import RebuildOptions, checked_rollout_ids

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_MASKED = 3
EXIT_EMPTY = 4
EXIT_INTERRUPTED = 130
EXIT_CLOSED_PIPE = 141

# Every exit status of the `raycap` command and the jobs, with what it means.
EXIT_STATUSES = {
    EXIT_OK: "done",
    EXIT_FAILED: "the work ran but part of it failed (a retirement, a finalize task, the output's file system "
    "while writing); nothing half-committed, and a rerun once the cause is fixed finishes it",
    EXIT_USAGE: "could not start: a bad argument or config, a missing capture directory or results file, a refused, "
    "locked or misplaced output, no Ray cluster to join, an output that cannot be read (inspect); nothing was written",
    EXIT_MASKED: "rebuild, finalize: the masked share exceeded max_mask_fraction; the rows were set aside as "
    "OUT.rejected and nothing was retired",
    EXIT_EMPTY: "rebuild: the capture directories hold no captured rollout; nothing was written "
    "(--allow-empty commits an empty dataset instead)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C, SIGINT): the lock is released, nothing half-committed; rerun",
    EXIT_CLOSED_PIPE: "stdout was closed early (`raycap inspect OUT | head`); nothing else is wrong",
}


def exit_table() -> str:
    """`EXIT_STATUSES` as the lines a --help ends with."""
    import textwrap

    lines = [
        textwrap.fill(text, 88, initial_indent=f"  {code:<4} ", subsequent_indent=" " * 7)
        for code, text in EXIT_STATUSES.items()
    ]
    return "exit status:\n" + "\n".join(lines)


def fail(prog: str, message: str, code: int = EXIT_USAGE) -> int:
    """Print the reason as one line on stderr and return the exit status."""
    print(f"{prog}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return code


class Console:
    """Where a command's lines go: `say` for the human lines (stdout, or stderr under
    --json, nothing under --quiet), `fail` for the one line of a failure (always stderr),
    `finish` for the end: under --json, one JSON document on stdout with the status."""

    def __init__(self, prog: str, *, quiet: bool = False, json: bool = False, command: str = "") -> None:
        self.prog, self.quiet, self.json = prog, quiet, json
        self.command = command or prog.rsplit(" ", 1)[-1].rsplit(".", 1)[-1]
        self.error: str | None = None
        self.hints: list[str] = []
        self.by_flags = False  # the user typed flags, not a config: refusals name the flags
        # A refusal's words for a user of flags: `--overwrite`, not the config key.
        self.wording: Callable[[str], str] = lambda text: text

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr if self.json else sys.stdout, flush=True)

    def note(self, text: str) -> None:
        """A line about the run (a warning, a hint), on stderr, named by the command."""
        if not self.quiet:
            print(f"{self.prog}: {text}", file=sys.stderr, flush=True)

    def hint(self, text: str) -> None:
        self.hints.append(text)
        self.note(text)

    def fail(self, message: str, code: int = EXIT_USAGE) -> int:
        self.error = " ".join(self.wording(str(message)).split())
        return fail(self.prog, self.error, code)

    def finish(self, status: int, **fields: Any) -> int:
        if self.json:
            document = {"command": self.command, "status": status, "error": self.error, "hints": self.hints, **fields}
            print(json.dumps(document, default=str, indent=None), flush=True)
        return status


def interrupted(console: Console, output: Any = None, text: str | None = None) -> int:
    """Ctrl-C: one line and status 130. The library unwinds as from any error (the lock
    released, a staging directory removed), so the line says only where the run got.
    The tasks it cancelled, or that fail once their staging is gone, are what was asked
    for: Ray is told not to report their errors as unhandled while the process leaves."""
    from pathlib import Path

    from raycap.output.manifest import is_committed

    os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"  # read by Ray as each error arrives

    if text is not None:
        return console.fail(f"interrupted; {text}", EXIT_INTERRUPTED)
    committed = False
    if isinstance(output, Path):
        try:
            committed = is_committed(output)
        except OSError:
            pass
    if committed:
        text = f"interrupted after {output} was committed; rerun to finish (the rows are reused, not rebuilt)"
    else:
        text = "interrupted; nothing was committed" + (f" to {output}" if output is not None else "") + ", rerun to start over"
    return console.fail(text, EXIT_INTERRUPTED)


def file_system_fault(console: Console, exc: OSError, output: object) -> int:
    """An OSError from the output's file system that no layer named (space, permissions,
    mounts): one line naming the file, and exit 1, since a rerun once it is fixed builds
    the rows (nothing was committed or retired)."""
    where = exc.filename or output
    return console.fail(
        f"{type(exc).__name__} on {where}: {exc.strerror or exc}; fix that file system (space, permissions, "
        "mounts) and rerun: nothing was committed or retired",
        EXIT_FAILED,
    )


def outcome_status(console: Console, outcome: Any, *, show: bool = True) -> int:
    """Print a handoff's summary (unless `show` is False) and give its exit status
    (`raycap.runs.handoff.Outcome`): 0 done, 3 rejected by the mask check, 1 when part
    of the retirement failed (the first errors on stderr; a rerun finishes it)."""
    from raycap.runs.handoff import DONE, REJECTED

    if show:
        console.say(outcome.summary.render())
    if outcome.status == DONE:
        return EXIT_OK
    if outcome.status == REJECTED:
        return console.fail(outcome.message, EXIT_MASKED)
    for error in outcome.summary.retired.errors[:10]:
        print(f"{console.prog}: retire: {error}", file=sys.stderr)
    return console.fail(outcome.message, EXIT_FAILED)


@dataclass(frozen=True)
class Arguments:
    config: str | None
    verbose: bool = False
    quiet: bool = False
    json: bool = False
    # Config keys given on the command line ("ray.address" for a nested one), and the
    # flag of every key the job takes as one.
    overrides: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)

    @property
    def dirs_from(self) -> str:
        """Where the capture directories came from, for an error line."""
        return "the DIR arguments" if "capture_dirs" in self.overrides or not self.config else str(self.config)


    @property
    def by_flags(self) -> bool:
        """Whether the user typed flags rather than a config: refusals then name flags."""
        return self.config is None

    def console(self, prog: str) -> Console:
        console = Console(prog, quiet=self.quiet, json=self.json)
        if self.by_flags:
            console.by_flags, console.wording = True, flag_wording
        return console


def flag_wording(text: str) -> str:
    """A library refusal's way out, reworded for a user of flags: the flag, not the key."""
    return (
        text.replace("set overwrite: true", "pass --overwrite")
        .replace("with overwrite: true", "with --overwrite")
        .replace("overwrite replaces only", "--overwrite replaces only")
    )


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default (`(default: ...)`), except where there is
    none to show (None: the config or the library decides, and the help says so), and
    keeps the description's and the exit table's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or "%(default)" in text or "default:" in text:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction, argparse._VersionAction)):
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}; see {self.prog} --help")


class CommandParser(argparse.ArgumentParser):
    """The parser of a command that is no job (demo, synth, inspect, config): a bad
    argument is one line on stderr and status 2, as for the jobs, not the usage again."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(formatter_class=HelpFormatter, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(self.prog, f"{message}; see {self.prog} --help")
        raise SystemExit(EXIT_USAGE)


def add_console_flags(parser: argparse.ArgumentParser, verbose: str) -> None:
    """-q/--quiet, -v/--verbose and --json, as every command that summarises takes them."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    group.add_argument("-v", "--verbose", action="store_true", help=verbose)
    parser.add_argument(
        "--json", action="store_true",
        help="print one JSON document on stdout when the command ends (keys: docs/jobs-and-cli.md); human lines go to stderr",
    )


# The flags of the jobs: each gives the config key of the same meaning, and wins over the
# config file's value. The values are passed on as given, so the config's own validation
# judges them. (flag, config key, metavar or "bool" or "list", jobs, help)
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
    ("--allow-empty", "allow_empty", "bool", "rebuild", "commit an empty dataset when the directories hold no rollout (else exit 4)"),
    ("--records", "records", "FILE", "clear", "the JSONL of run records about to be dispatched"),
    ("--older-than-seconds", "older_than_seconds", "S", "sweep", "remove tombstones older than this"),
    ("--address", "ray.address", "ADDR", "rebuild finalize clear sweep",
     "join the Ray cluster there (default: RAY_ADDRESS, else an embedded Ray)"),
)
from raycap.errors import (
    CannotStart,  # noqa: F401 - raised here, declared with the others
    UsageError,  # noqa: F401 - raised here, declared with the others
)

_USAGE = {
    "rebuild": "DIR... --output OUT [--retire] [--executor E]",
    "finalize": "DIR... --results FILE --output OUT [--records-file FILE] [--retire] [--executor E]",
    "clear": "DIR... --records FILE",
    "sweep": "DIR... --older-than-seconds S",
}
_NEEDS = {
    "rebuild": "the capture directories and --output",
    "finalize": "the capture directories, --results and --output",
    "clear": "the capture directories and --records",
    "sweep": "the capture directories and --older-than-seconds",
}
_PATH_KEYS = ("output", "results", "records_file", "rollout_ids_file", "records")


def _config_default(job: str, key: str) -> str | None:
    """The config's default for `key` as help shows it; None when the key is required."""
    from pydantic_core import PydanticUndefined

    from raycap.cli.jobconfig import JOB_CONFIGS

    fields = JOB_CONFIGS[job].model_fields
    if key not in fields or fields[key].default is PydanticUndefined:
        return None
    value = fields[key].default
    if value is None or value == "":
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _from_here(key: str, value: str) -> str:
    """A path given on the command line, taken from the current directory (a config's
    are taken from its own); URIs and node-qualified directories as they are."""
    from raycap.output.location import is_uri

    if is_uri(value) or (key == "capture_dirs" and ":/" in value and not value.startswith("/")):
        return value
    return os.path.abspath(os.path.expanduser(value))


def parse_arguments(prog: str, description: str, argv: Sequence[str] | None, job: str | None = None) -> Arguments:
    """The job's arguments: the capture directories, `--config FILE` and the flags of
    `_FLAGS` for `job` ("rebuild", "finalize", "clear", "sweep"), any of which may stand
    without a config, and the console flags. `prog` is how the job is named:
    "jobs.rebuild" under `python -m`, or the `raycap` command's "raycap rebuild". A bad
    argument raises UsageError."""
    job = job or prog.rsplit(".", 1)[-1].rsplit(" ", 1)[-1]
    shown = prog if prog.startswith("raycap") else f"python -m {prog}"
    parser = _Parser(
        prog=shown, description=description, usage=f"%(prog)s {_USAGE[job]} [--config FILE] [options]",
        formatter_class=HelpFormatter, epilog=exit_table(),
    )
    flags: dict[str, str] = {}
    parser.add_argument("dirs", nargs="*", metavar="DIR", help="capture directories (plain paths or NODE:/path)")
    parser.add_argument(
        "--config", metavar="FILE",
        help=f"a YAML config (`raycap config {job}` prints a commented one); flags win over its keys",
    )
    flags["capture_dirs"] = "DIR"
    for flag, key, kind, jobs, text in _FLAGS:
        if job not in jobs.split():
            continue
        flags[key] = flag
        default = None if "." in key else _config_default(job, key)
        if default is not None and "default:" not in text:
            text = f"{text} (default: {default})"
        if kind == "bool":
            parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif kind == "list":
            parser.add_argument(flag, dest=key, action="append", metavar="NAME", help=text)
        else:
            parser.add_argument(flag, dest=key, metavar=kind, help=text)
    add_console_flags(
        parser, "log every masked rollout and each failed build's full error (default: the summary is the record)"
    )
    # Directories may come before, between or after the flags.
    args = vars(parser.parse_intermixed_args(argv))
    overrides: dict[str, Any] = {}
    if args["dirs"]:
        overrides["capture_dirs"] = [_from_here("capture_dirs", d) for d in args["dirs"]]
    for key in flags:
        value = args.get(key)
        if key != "capture_dirs" and value is not None:
            overrides[key] = _from_here(key, value) if key in _PATH_KEYS else value
    if args["config"] is None and not overrides:
        raise UsageError(f"give {_NEEDS[job]} (or --config FILE); see {shown} --help")
    return Arguments(args["config"], args["verbose"], args["quiet"], args["json"], overrides, flags)


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
        with job_console():  # progress lines, and Ray's worker lines without colour codes in a log
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
    config: CaptureJobConfig, config_path: str, *, executor: str = "ray", rollout_ids: Sequence[str] | None = None,
    refuses_empty: bool = False,
) -> None:
    """Connect and start the actors of the capture directories' nodes, or raise CannotStart;
    when the work runs in this process (see `uses_ray`), only check the directories here.

    A capture directory that does not exist, or an actor that cannot start, is reported
    here, before any work, as a job that could not start. Plain paths are checked on this
    machine first when Ray would run here, which saves starting Ray for a typo. A job that
    `refuses_empty` starts no actor for directories this machine alone shows to be empty
    (`raycap.runs.handoff.nothing_here`): the job refuses them next."""
    if runs_embedded(config.ray) or executor == "local":
        missing = config.missing_local_dirs()
        if missing:
            raise CannotStart(f"capture directory {missing[0]} does not exist; check capture_dirs in {config_path}")
    try:
        if not uses_ray(config, executor, rollout_ids):
            return
    except (ValueError, FileNotFoundError) as exc:
        raise CannotStart(str(exc)) from None
    if refuses_empty and not runs_embedded(config.ray):  # an embedded one was asked before it started
        from raycap.runs.handoff import nothing_here

        options = RebuildOptions(executor=executor, skip_retired=rollout_ids is None)
        if nothing_here(tuple(config.capture_dirs), checked_rollout_ids(rollout_ids), options, config.ray.address):
            return  # asked of this machine and the cluster's GCS: the job refuses them without joining
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


def directory_job(
    prog: str, description: str, argv: Sequence[str] | None, *, job: str, config_type: type[CaptureJobConfig],
    work: Callable[[Any, Any, Console], int], stopped: str, prepare: Callable[[Any], Any] | None = None,
) -> int:
    """The one run and main of a job that works on capture directories through their
    actors (`clear`, `sweep`): arguments, console, logging, the config (and what `prepare`
    reads from it: a ValueError or OSError there is a refusal, like a bad config), the
    node actors, then `work(config, prepared, console)` for the exit status. Ctrl-C ends it with one
    line, `stopped` saying what a rerun does."""
    from raycap.cli.jobconfig import ConfigError, load_job_config

    try:
        args = parse_arguments(prog, description, argv, job=job)
    except UsageError as exc:
        return fail(prog, str(exc))
    console = args.console(prog)
    with job_logging(args.verbose):
        try:
            try:
                config = load_job_config(args.config, config_type, args.overrides, args.flags)
                prepared = prepare(config) if prepare is not None else None
                ensure_fleet(config, args.dirs_from)
            except (ConfigError, CannotStart, ValueError, OSError) as exc:
                return console.finish(console.fail(str(exc)))
            return work(config, prepared, console)
        except KeyboardInterrupt:
            return console.finish(interrupted(console, text=stopped))
