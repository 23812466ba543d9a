"""Benchmark of one step batch: what a training step's builder task does on its node.

Run: `python -m bench.batch` (options: `--help`). A directory holds `--history` small
two-call rollouts (the step benchmark's, `bench.step`); each batch writes `--rollouts`
fresh ones as a writer without an index leaves them, then times
`raycap.rows.batch.freeze_and_build` on them in one process: lock, freeze, state files
made durable, parse, build, the Arrow rows. The batch's rollouts are removed after it, as
a step's are retired, so the directory keeps its history; with `--keep` they stay until
the run ends (the directory grows by the same rollouts for every tree). The first two
batches of a process are not timed (imports, first allocations).

Each round runs every source tree in a fresh process, one after the other in an order
that alternates; `--base DIR` adds another checkout (today's code, say), whose
`freeze_and_build` takes the same arguments. Reported per tree: the median over rounds
of each process's median batch wall time and CPU time (user + sys, its threads
included, and each part), and for `--base` the median of the rounds' ratios this / base.
CPU time moves less with a shared machine's load than wall time does. The system part
carries most of the noise: on a file system without a journal, creating a file costs
the kernel more while many files were deleted in the last minutes, so with removals
that cost grows over a run; `--keep` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.proc import REPO, _env, _python, _run

_CHILD = r"""
import json, os, resource, statistics, sys, time
repo, tree, directory, rollouts, batches, keep = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "keep"
sys.path.insert(0, repo)
import numpy as np
from bench.step import remove_rollouts, write_rollouts
sys.path.insert(0, tree)
from raycap.capture.store import TokenCaptureStore
from raycap.rows.batch import freeze_and_build

store = TokenCaptureStore(directory, create=False)
rng = np.random.default_rng(3)
tag = os.urandom(3).hex()
walls, users, systems = [], [], []
for batch in range(2 + batches):
    ids = [f"s{tag}-{batch}-{k}" for k in range(rollouts)]
    write_rollouts(store.directory, ids, rng)
    os.sync()  # the writer's writeback must not land inside the timed batch
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    table = freeze_and_build(store, ids, directory, max_bytes=None, builder="prefix_merging", model="", delivery="rollout")
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    masked = sum(table.column("mask_sample").to_pylist())
    if table.num_rows != rollouts or masked:
        sys.exit(f"batch {batch}: {table.num_rows} rows, {masked} masked; expected {rollouts} unmasked rows")
    if not keep:
        remove_rollouts(store.directory, ids)
    if batch >= 2:
        walls.append(wall)
        users.append(after.ru_utime - before.ru_utime)
        systems.append(after.ru_stime - before.ru_stime)
cpus = [u + s for u, s in zip(users, systems)]
print(json.dumps({what: statistics.median(values) for what, values in (("wall", walls), ("cpu", cpus), ("user", users), ("sys", systems))}))
"""


def run_process(tree: Path, directory: Path, rollouts: int, batches: int, keep: bool) -> dict:
    """One fresh process timing `batches` batches with `tree`'s raycap: the medians of
    their wall times, CPU times and its user and system parts."""
    argv = _python(_CHILD, str(REPO), str(tree), str(directory), str(rollouts), str(batches), "keep" if keep else "remove")
    run = _run(argv, _env(), cwd=directory.parent, what=f"the batch process for {tree}")
    return json.loads(run.lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=32, help="fresh rollouts per batch (default %(default)s: a 64-id step's batch on 2 CPUs)")
    parser.add_argument("--history", type=int, default=500, help="rollouts the directory holds (default %(default)s)")
    parser.add_argument("--batches", type=int, default=12, help="timed batches per process (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each a fresh process per tree (default %(default)s)")
    parser.add_argument("--base", help="also time this source tree (a checkout of another commit), interleaved")
    parser.add_argument("--keep", action="store_true", help="keep each batch's rollouts until the run ends: files are created where none was deleted lately")
    parser.add_argument("--work", help="directory for the rollouts (default: a temporary one, removed after)")
    args = parser.parse_args(argv)
    from bench.step import history_dir

    trees = {"this": REPO}
    if args.base:
        base = Path(args.base).resolve()
        if not (base / "raycap" / "rows" / "batch.py").is_file():
            parser.error(f"--base {base} is not a raycap checkout (no raycap/rows/batch.py)")
        trees = {"base": base, "this": REPO}
    temporary = None if args.work else tempfile.TemporaryDirectory(prefix="raycap-bench-batch-")
    work = Path(args.work or temporary.name)
    try:
        directory = history_dir(work, args.history, 7)
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for round_no in range(args.rounds):
            order = list(trees) if round_no % 2 else list(trees)[::-1]
            for name in order:
                runs[name].append(run_process(trees[name], directory, args.rollouts, args.batches, args.keep))
            print(f"round {round_no + 1}: " + json.dumps({name: runs[name][-1] for name in trees}), file=sys.stderr)
        history_dir(work, args.history, 7)  # removes the batches' rollouts a --keep run left
    finally:
        if temporary is not None:
            temporary.cleanup()
    print(f"batch of {args.rollouts} fresh rollouts in a directory of {args.history}; medians of {args.rounds} rounds")
    for name, results in runs.items():
        wall, cpu, user, system = (statistics.median(r[what] for r in results) for what in ("wall", "cpu", "user", "sys"))
        print(f"  {name:6s} wall {wall * 1e3:6.1f} ms   CPU {cpu * 1e3:6.1f} ms (user {user * 1e3:5.1f}, sys {system * 1e3:5.1f})")
    if "base" in runs:
        for what in ("wall", "cpu", "user", "sys"):
            ratios = [this[what] / base[what] for this, base in zip(runs["this"], runs["base"])]
            print(f"  this / base, {what}: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
