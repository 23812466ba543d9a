"""The `raycap` command (also `python -m raycap`): the jobs, a corpus writer and a look at an output.

    raycap rebuild DIR... --output OUT [--retire] [--executor E] [--config FILE] ...
    raycap finalize DIR... --results FILE --output OUT [--records-file FILE] [--config FILE] ...
    raycap demo [--config FILE] [--rollouts N]  a synthetic corpus through the rebuild
    raycap synth OUT_DIR [--rollouts N ...]     write a synthetic capture corpus
    raycap inspect OUTPUT [--png PATH] [--bins N]
    raycap --version

`rebuild`, `finalize` and `demo` are the entry points `python -m jobs.rebuild`, `python -m
jobs.finalize` and `python -m jobs.demo` (the same functions, arguments and exit
statuses, see `jobs`), named `raycap ...` in their usage and error lines: the command is
another way to start them, not a second implementation, and `ray job submit` keeps
running `python -m jobs.<name>`. Their flags and a config file combine, the flags
winning key by key, through the config's one validation. `synth` is `python -m raycap.cli.synth`.

`inspect` reports an output's rows, masks by reason and the token lengths of its
trainable rows with a text histogram (`raycap.cli.inspection`), and writes the histogram as
a PNG next to the output (`<output>.lengths.png`, or --png PATH) when matplotlib is
installed; otherwise it says so. The PNG is its only write and never lands inside an
output: for a path inside one (a shard, `data/`) it goes beside that output, and a
--png inside an output is refused before anything is read. Exit status 0, or 2 with one
line on stderr when the output cannot be read or the PNG would land inside an output.
An output given as a URI (`s3://...`) is read from its store, and its PNG goes to the
working directory (`./NAME.lengths.png`) or --png, never to the store.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Callable, Sequence

PROG = "raycap"
EXIT_USAGE = 2  # as in `jobs`: the command could not start

_COMMANDS = {
    "rebuild": "DIR... --output OUT: capture directories in, one durable Parquet dataset out",
    "finalize": "DIR... --results FILE --output OUT: a results file finalized into one durable dataset",
    "demo": "a synthetic corpus through the rebuild, for a first look",
    "synth": "OUT_DIR: write a synthetic token-capture corpus",
    "inspect": "counts, mask reasons and token lengths of an output, with a histogram",
}


def ending(status: int) -> int:
    """`status`, for a command whose process exits next (`sys.exit(ending(main()))`).

    Its outputs are written, fsynced and closed, and its logs are flushed at exit as
    always; what the exit would still do is walk every object the process holds in the
    interpreter's last garbage collections, a fifth of a second with pyarrow, pydantic and
    raycap loaded, only to free memory the exit frees anyway. Freezing them skips that.
    The Ray it used is left now (`raycap.cluster.connect.leave`): an embedded instance
    is stopped without the pauses Ray's own exit hook takes. Only for a process that
    runs nothing else: a caller of `main` in its own process (a test, a notebook) keeps
    its collector and its Ray as they were."""
    if "ray" in sys.modules:  # a command that never used Ray does not import it now
        from raycap.cluster.connect import leave

        leave()
    gc.freeze()
    return status


def console() -> int:
    """The `raycap` console script: `main`, in a process of its own."""
    return ending(main())


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"{PROG}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return code


def _job(name: str) -> Callable[[Sequence[str]], int] | None:
    """`main` of `jobs.<name>`, or None when the jobs package cannot be imported."""
    import importlib

    try:
        return importlib.import_module(f"raycap.cli.{name}").main
    except ModuleNotFoundError as exc:
        if exc.name not in ("jobs", f"jobs.{name}"):
            raise
        return None


def _inspect(argv: Sequence[str]) -> int:
    from raycap.cli.inspection import (
        HISTOGRAM_BINS,
        InspectError,
        checked_png_path,
        default_png_path,
        inspect_output,
        write_png,
    )

    parser = argparse.ArgumentParser(prog=f"{PROG} inspect", description=_COMMANDS["inspect"])
    parser.add_argument("output", help="the output directory (or one Parquet file) a rebuild wrote")
    parser.add_argument(
        "--png", help="where to write the histogram, outside any output (default: <output>.lengths.png next to it)"
    )
    parser.add_argument("--bins", type=int, default=HISTOGRAM_BINS, help="histogram bins (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.bins < 1:
        return _fail(f"--bins must be at least 1, not {args.bins}")
    try:
        # Where the PNG goes is settled before anything is read, so a refused place costs nothing.
        png_path = checked_png_path(args.png) if args.png else default_png_path(args.output)
        report = inspect_output(args.output)
    except InspectError as exc:
        return _fail(str(exc))
    print(report.render(args.bins), flush=True)
    try:
        png = write_png(report, png_path, args.bins)
    except InspectError as exc:  # the place changed since it was checked
        return _fail(str(exc))
    print(f"histogram: {png.path}" if png.path is not None else f"histogram: no PNG: {png.reason}", flush=True)
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
    if command == "synth":
        from raycap.cli.synth import main as synth_main

        return synth_main(rest)
    if command in ("rebuild", "finalize", "demo"):
        job = _job(command)
        if job is None:
            return _fail(
                f"the job entry points (the `jobs` package) are not importable here; run {PROG} {command} "
                "from a raycap checkout, or reinstall raycap (pip install -e .) so they are installed with it"
            )
        return job(rest, prog=f"{PROG} {command}") if command != "demo" else job(rest)
    return _fail(f"unknown command {command!r}; one of: {', '.join(_COMMANDS)}")
