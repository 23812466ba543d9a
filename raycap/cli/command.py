"""The `raycap` command (also `python -m raycap`): the jobs, a corpus writer, a look at an output.

    raycap rebuild DIR... --output OUT [--retire] [--executor E] [--config FILE] ...
    raycap finalize DIR... --results FILE --output OUT [--records-file FILE] [--config FILE] ...
    raycap clear DIR... --records FILE [--config FILE]
    raycap sweep DIR... --older-than-seconds S [--config FILE]
    raycap demo [DIR]                           a synthetic corpus through the rebuild, in DIR
    raycap synth OUT_DIR [--rollouts N ...]     write a synthetic capture corpus
    raycap inspect OUTPUT [--png PATH] [--bins N]
    raycap config [NAME]                        print a commented example config
    raycap --version

The jobs are the functions a checkout's `python -m jobs.<name>` runs (the same arguments
and exit statuses, `raycap.cli.jobs.EXIT_STATUSES`), named `raycap ...` in their usage
and error lines. Every command that summarises takes -q/--quiet, -v/--verbose and
--json (one JSON document on stdout, the human lines on stderr).

A closed stdout (`raycap inspect OUT | head -2`) ends the command quietly with status
141, as a process killed by SIGPIPE; Ctrl-C ends it with one line and status 130
(`run_entry`, which every entry point goes through).

`inspect` reports an output's rows, masks and token lengths (`raycap.cli.inspection`,
where its PNG's place is told): exit status 0, or 2 with one line on stderr when the
output cannot be read or the PNG would land inside an output.
"""

from __future__ import annotations

import gc
import sys
from typing import Callable, Sequence

PROG = "raycap"
EXIT_USAGE = 2  # as in `jobs`: the command could not start

_COMMANDS = {
    "rebuild": "DIR... --output OUT: capture directories in, one durable Parquet dataset out",
    "finalize": "DIR... --results FILE --output OUT: a results file finalized into one durable dataset",
    "clear": "DIR... --records FILE: delete stale captures of the rollouts about to be dispatched",
    "sweep": "DIR... --older-than-seconds S: remove retired tombstones older than that",
    "demo": "[DIR]: a synthetic corpus through the rebuild, in DIR (default: here), for a first look",
    "synth": "OUT_DIR: write a synthetic token-capture corpus",
    "inspect": "OUTPUT: counts, mask reasons and token lengths of an output, with a histogram",
    "config": "[NAME]: print a commented example config (rebuild, finalize, clear, sweep, cluster, demo)",
}
# `raycap config NAME`: the packaged example configs (raycap/configs/), by the job they configure.
CONFIGS = {
    "rebuild": "demo.yaml", "demo": "demo.yaml", "cluster": "cluster.yaml", "finalize": "finalize.yaml",
    "clear": "clear.yaml", "sweep": "sweep.yaml",
}


def ending(status: int) -> int:
    """`status`, for a command whose process exits next (`sys.exit(ending(main()))`).

    Its outputs are written, fsynced and closed, and its logs are flushed at exit as
    always; what the exit would still do is walk every object the process holds in the
    interpreter's last garbage collections, a fifth of a second with pyarrow, pydantic and
    raycap loaded, only to free memory the exit frees anyway. Freezing them skips that.
    The Ray it used is left now (`raycap.cluster.plumbing.connect.leave`): an embedded instance
    is stopped without the pauses Ray's own exit hook takes. Only for a process that
    runs nothing else: a caller of `main` in its own process (a test, a notebook) keeps
    its collector and its Ray as they were."""
    if "ray" in sys.modules:  # a command that never used Ray does not import it now
        from raycap.cluster.plumbing.connect import leave

        leave()
    gc.freeze()
    return status


def console() -> int:
    """The `raycap` console script: `main`, in a process of its own."""
    return ending(run_entry(main))


def run_entry(entry: Callable[[], int]) -> int:
    """`entry()`'s status, for a process that exits next, ending quietly on a closed
    stdout (141, as a process killed by SIGPIPE: `raycap inspect OUT | head`) and with
    one line on Ctrl-C (130). Each job catches Ctrl-C itself to name what it left; this
    catches it anywhere else (while Python or Ray loads)."""
    try:
        status = entry()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # Python would report the failed flush of stdout at exit: point it at nothing.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"{PROG}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return code


def _inspect(argv: Sequence[str]) -> int:
    from raycap.cli.inspection import (
        HISTOGRAM_BINS,
        InspectError,
        checked_png_path,
        default_png_path,
        inspect_output,
        write_png,
    )
    from raycap.cli.jobs import CommandParser, Console, add_console_flags, exit_table

    parser = CommandParser(
        prog=f"{PROG} inspect", description=_COMMANDS["inspect"].split(": ", 1)[1],
        epilog=exit_table(),
    )
    parser.add_argument("output", help="the output directory (or one Parquet file) a rebuild wrote")
    parser.add_argument(
        "--png", help="where to write the histogram, outside any output (default: <output>.lengths.png next to it)"
    )
    parser.add_argument("--no-png", action="store_true", help="write no PNG")
    parser.add_argument("--bins", type=int, default=HISTOGRAM_BINS, help="histogram bins")
    add_console_flags(parser, "the same report (inspect has nothing more to say)")
    args = parser.parse_args(argv)
    out = Console(f"{PROG} inspect", quiet=args.quiet, json=args.json, command="inspect")
    if args.bins < 1:
        return out.finish(out.fail(f"--bins must be at least 1, not {args.bins}"))
    try:
        # Where the PNG goes is settled before anything is read, so a refused place costs nothing.
        png_path = None if args.no_png else checked_png_path(args.png) if args.png else default_png_path(args.output)
        report = inspect_output(args.output)
    except InspectError as exc:
        return out.finish(out.fail(str(exc)))
    out.say(report.render(args.bins))
    png = None
    if png_path is not None:
        try:
            png = write_png(report, png_path, args.bins)
        except InspectError as exc:  # the place changed since it was checked
            return out.finish(out.fail(str(exc)))
        out.say(f"histogram: {png.path}" if png.path is not None else f"histogram: no PNG: {png.reason}")
    return out.finish(
        0, **report.to_json(args.bins), png=None if png is None or png.path is None else str(png.path),
        png_note=None if png is None else png.reason or None,
    )


def _config(argv: Sequence[str]) -> int:
    from raycap.cli.demo import DEMO_CONFIG
    from raycap.cli.jobs import CommandParser

    parser = CommandParser(
        prog=f"{PROG} config",
        description="Print a commented example config to start from: raycap config rebuild > rebuild.yaml, edit it, "
        "then raycap rebuild --config rebuild.yaml. Relative paths in a config are taken from its own folder.",
    )
    parser.add_argument("name", nargs="?", choices=sorted(CONFIGS), help="the job to configure (default: list them)")
    args = parser.parse_args(argv)
    if args.name is None:
        width = max(map(len, CONFIGS))
        for name in CONFIGS:
            print(f"{name:<{width}}  {PROG} config {name} > {name}.yaml")
        return 0
    sys.stdout.write((DEMO_CONFIG.parent / CONFIGS[args.name]).read_text())
    return 0


def version() -> str:
    """The installed distribution's version, else the package's own `__version__`."""
    from importlib import metadata

    try:
        return metadata.version("raycap")
    except metadata.PackageNotFoundError:
        from raycap import __version__

        return __version__


def _usage() -> str:
    width = max(map(len, _COMMANDS))
    commands = "\n".join(f"  {name:<{width}}  {text}" for name, text in _COMMANDS.items())
    return (
        f"usage: {PROG} COMMAND [ARGS]  ({PROG} COMMAND --help for its arguments)\n"
        f"       {PROG} --version\n\ncommands:\n{commands}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else EXIT_USAGE
    if argv[0] in ("--version", "-V"):
        print(f"{PROG} {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "inspect":
        return _inspect(rest)
    if command == "config":
        return _config(rest)
    if command in _COMMANDS:
        import importlib

        return importlib.import_module(f"raycap.cli.{command}").main(rest, prog=f"{PROG} {command}")
    return _fail(f"unknown command {command!r}; one of: {', '.join(_COMMANDS)}")
