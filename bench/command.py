"""Benchmark of a command's fixed cost: `raycap rebuild DIR --output OUT --executor ray`.

Run: `python -m bench.command [--base DIR] [--repeat 3]`. Each run is the command as a
user types it (`python -m raycap rebuild ...`, in a new process), timed from spawn to
exit, over two inputs:

- `empty`: an empty capture directory, so what is timed is the command's fixed cost:
  imports, Ray's start or join, the set-up and the way out (exit status 4: nothing
  was built or written, as without --allow-empty);
- `corpus`: a fresh copy of the batch benchmark's corpus (`bench.run`, 120 rollouts).

Each input runs two ways:

- `embedded`: the command starts its own Ray (no RAY_ADDRESS);
- `joined`: RAY_ADDRESS names a running `ray start --head` cluster of the benchmark's
  own (`bench.proc.RayHead`), as under `ray job submit`; one untimed command per tree
  joins it first, so the head's workers are up as on a cluster in use.

Every embedded run has a temp directory of its own (RAY_TMPDIR), so the processes it
started can be told apart from any other Ray on the machine: a process still running
with that directory in its command line two seconds after the command exited is
counted as left behind, and reported.

`--base DIR` runs another checkout (the previous commit, say) the same way in the same
rounds, interleaved with this one (the order alternating), and the report gives both
medians and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.proc import REPO, RayHead, _env, _run, fresh_copy
from bench.run import ensure_corpus

LEFTOVER_GRACE_S = 2.0


def _leftovers(marker: str) -> list[str]:
    """The processes whose command line names `marker` (an embedded run's temp directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in argv:
            found.append(f"{entry} {argv[:80]}")
    return found


def _one(tree: str, capture_dir: Path, work: Path, head: RayHead | None) -> tuple[float, list[str]]:
    """One command: (seconds from spawn to exit, processes of its own Ray left running)."""
    output = work / "out"
    for stale in (output, work / "out.summary.json"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    temp = tempfile.mkdtemp(prefix="rc-", dir="/tmp")  # short: Ray's socket paths must fit
    env = head.env() if head is not None else _env(RAY_TMPDIR=temp)
    env["PYTHONPATH"] = tree
    argv = [sys.executable, "-m", "raycap", "rebuild", str(capture_dir), "--output", str(output), "--executor", "ray"]
    try:
        expect = 0 if any(capture_dir.iterdir()) else 4  # no captured rollouts: exit 4
        run = _run(argv, env, cwd=Path(tree), what=f"raycap rebuild {capture_dir}", expect=expect)
        time.sleep(LEFTOVER_GRACE_S)
        return run.exited, _leftovers(temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.command", description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="also time this source tree (a checkout of another commit), interleaved")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the joined head")
    parser.add_argument("--inputs", default="empty,corpus", help="comma-separated: empty, corpus")
    parser.add_argument("--ways", default="embedded,joined", help="comma-separated: embedded, joined")
    parser.add_argument("--work", type=Path, default=Path("out/bench"))
    args = parser.parse_args(argv)
    trees = {"this": str(REPO)}
    if args.base:
        trees["base"] = str(Path(args.base).resolve())
    inputs, ways = args.inputs.split(","), args.ways.split(",")
    args.work = args.work.resolve()  # each command runs in its own tree's directory
    args.work.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="command-", dir=args.work))
    empty = scratch / "empty"
    empty.mkdir()
    corpus = ensure_corpus(args.work, 120, 0, 0.1) if "corpus" in inputs else None
    times: dict[tuple[str, str, str], list[float]] = {}
    left: list[str] = []
    head = RayHead(args.cpus).__enter__() if "joined" in ways else None
    try:
        if head is not None:  # the head's first driver starts its workers: not a command's own cost
            for tree in trees.values():
                _one(tree, empty, scratch, head)
        for round_ in range(args.repeat):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for what in inputs:
                for way in ways:
                    for tree in order:
                        capture = empty if what == "empty" else fresh_copy(corpus, scratch, "copy")
                        seconds, leftover = _one(trees[tree], capture, scratch, head if way == "joined" else None)
                        times.setdefault((what, way, tree), []).append(seconds)
                        left += [f"{tree} {what} {way}: {p}" for p in leftover]
                        print(f"round {round_ + 1}: {what:6} {way:8} {tree:4} {seconds:6.2f} s", file=sys.stderr, flush=True)
    finally:
        if head is not None:
            head.__exit__(None, None, None)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nraycap rebuild DIR --executor ray, seconds from spawn to exit (medians of {args.repeat})")
    header = f"{'input':7} {'way':9}" + "".join(f" {t:>8}" for t in trees) + ("    this/base, median of the rounds" if "base" in trees else "")
    print(header)
    for what in inputs:
        for way in ways:
            medians = {t: statistics.median(times[(what, way, t)]) for t in trees}
            line = f"{what:7} {way:9}" + "".join(f" {medians[t]:8.2f}" for t in trees)
            if "base" in trees:
                # Each round's pair ran back to back: the median of their ratios moves less
                # with a shared machine's load than the ratio of the medians.
                pairs = statistics.median(t / b for t, b in zip(times[(what, way, "this")], times[(what, way, "base")]))
                line += f"    {pairs:.2f}x"
            runs = "; ".join(f"{t}: " + " ".join(f"{s:.2f}" for s in times[(what, way, t)]) for t in trees)
            print(f"{line}    ({runs})")
    print(f"processes of an embedded Ray left running {LEFTOVER_GRACE_S:g} s after exit: {len(left)}")
    for line in left:
        print(f"  {line}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
