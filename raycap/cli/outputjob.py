"""The one run and main of the jobs that write one dataset: `raycap rebuild` and `raycap finalize`.

Each job is an `OutputJob`: its name, its config model, the library call it makes and
the errors that mean it could not start. `run` makes the call on a validated config and
turns what happened into an exit status (`raycap.cli.jobs.EXIT_STATUSES`); `main` reads
the arguments (flags, `--config FILE`, or both), runs, and ends the way every command
ends: a one-line refusal, the summary, and under `--json` one document on stdout.

What a careless run is told, once: capture directories with no captured rollout (exit
4, nothing written, unless `allow_empty`), and a run whose every row was masked because
no capture holds its rollout (the rollout ids may be wrong). Ctrl-C ends the job with
one line and status 130: the library's own unwinding has released the lock and
removed what was staged, so the next run proceeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pydantic import BaseModel

from raycap.capture.consumer import NO_RECORDS  # the mask reason of a rollout no capture holds
from raycap.cli.jobconfig import ConfigError, load_job_config
from raycap.cli.jobs import (
    EXIT_EMPTY,
    EXIT_FAILED,
    EXIT_USAGE,
    CannotStart,
    Console,
    UsageError,
    fail,
    file_system_fault,
    interrupted,
    job_logging,
    outcome_status,
    parse_arguments,
    runs_embedded,
)
from raycap.output.faults import NoRollouts, OutputError, OutputWriteError
from raycap.runs.handoff import Outcome


@dataclass(frozen=True)
class OutputJob:
    name: str  # "rebuild": the `raycap` subcommand
    prog: str  # "jobs.rebuild": its name under `python -m`
    description: str
    model: type[BaseModel]
    # The library call: (config, where the directories came from, verbose, console) -> Outcome.
    call: Callable[[Any, str, bool, Console], Outcome]
    refused: tuple[type[BaseException], ...] = (OutputError, CannotStart)  # exit 2: could not start
    failed: tuple[type[BaseException], ...] = ()  # exit 1: part of the work failed for good


def run(
    job: OutputJob, config: Any, *, config_path: str = "", verbose: bool = False, prog: str | None = None,
    console: Console | None = None, show: bool = True,
) -> tuple[Outcome | None, int]:
    """The job on a validated config: (outcome or None, exit status). `show` False keeps
    the summary off the console (the demo's preview)."""
    console = console or Console(prog or job.prog)
    if runs_embedded(config.ray) or config.executor == "local":
        # Checked before the library is called, so a typo costs no Ray start and no lock.
        missing = config.missing_local_dirs()
        if missing:
            return None, console.fail(f"capture directory {missing[0]} does not exist; check capture_dirs in {config_path}")
    try:
        outcome = job.call(config, config_path, verbose, console)
    except NoRollouts as exc:
        way_out = "pass --allow-empty" if console.by_flags else "set allow_empty: true"
        return None, console.fail(
            f"{exc}; check the capture directories (a wrong path, or captures not arrived yet), or {way_out} "
            "to commit an empty dataset",
            EXIT_EMPTY,
        )
    except OutputWriteError as exc:
        # The output's file system failed mid-run: nothing was committed or retired,
        # and a rerun once it is fixed builds the rows.
        return None, console.fail(str(exc), EXIT_FAILED)
    except job.refused as exc:
        return None, console.fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        return None, file_system_fault(console, exc, config.output)
    except job.failed as exc:
        # A task failed for good: nothing was committed or retired.
        return None, console.fail(str(exc), EXIT_FAILED)
    status = outcome_status(console, outcome, show=show)
    _hint_wrong_ids(console, outcome)
    return outcome, status


def _hint_wrong_ids(console: Console, outcome: Outcome) -> None:
    """Every row masked because no capture holds its rollout: the ids (or the results
    file, or the capture directories) are likely not the ones meant."""
    summary = outcome.summary
    rows = summary.row_count
    if rows and summary.masked == rows and summary.masked_by_reason.get(NO_RECORDS) == rows:
        console.hint(
            f"every one of the {rows:,} rollouts was masked: {NO_RECORDS}. The rollout ids may be wrong, or the "
            "captures are in other capture directories: check them against the directories' *.tokens.jsonl files"
        )


def main(job: OutputJob, argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """The job from its arguments: `--config FILE`, the flags, or both (flags win). `prog`
    names it in usage and error lines (the `raycap` command passes "raycap rebuild")."""
    prog = prog or job.prog
    try:
        args = parse_arguments(prog, job.description, argv, job=job.name)
    except UsageError as exc:
        return fail(prog, str(exc))
    console = args.console(prog)
    outcome, config = None, None
    with job_logging(args.verbose):
        try:
            config = load_job_config(args.config, job.model, args.overrides, args.flags)
        except ConfigError as exc:
            return console.finish(console.fail(str(exc)))
        try:
            outcome, status = run(job, config, config_path=args.dirs_from, verbose=args.verbose, console=console)
        except KeyboardInterrupt:
            status = interrupted(console, config.output)
    summary = None if outcome is None else outcome.summary.to_json()
    output = None if config is None else str(config.output)
    return console.finish(status, output=output, outcome=None if outcome is None else outcome.status, summary=summary)


def log_to(console: Console) -> Callable[[str], None]:
    """The library's notes for the run, as the console prints them."""
    return lambda message: console.note(message)


def progress_for(console: Console, label: str) -> Any:
    """The progress line of a run, none under --quiet or --json."""
    if console.quiet or console.json:
        return None
    from raycap.observe.progress import ProgressLine

    return ProgressLine(label)

