"""Benchmark: raycap's rebuild against the JSON parse floor and a straightforward consumer.

One process run times, on the same generated corpus (each contender on its own copy,
because the first freeze writes state):

  (a) parse floor    read + orjson.loads of every JSONL line, one core
  (b) baseline       the straightforward per-rollout consumer: pydantic records, the
                     reference builder with a token-trie parent search, sequentially
  (c) rebuild        raycap.rebuild on an already-started Ray (warm workers)
  (d) fresh process  a new Python process that imports raycap and rebuilds (Ray start included)

and a long-rollout case (one rollout of ~1,000 calls). It prints medians, the ratios the
performance targets are stated in, peak memory (this process and its Ray processes), and
whether (b) and (c) produced identical builds.

    python -m jobs.bench [--rollouts 120] [--repeat 3] [--cpus 2] [--work DIR]
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson

from raycap.synth import CorpusSpec, generate_corpus, long_rollout


class PeakMemory:
    """Peak RSS of this process plus all its descendants (the embedded Ray), sampled."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        return sum(_rss(pid) for pid in _descendants(os.getpid()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakMemory":
        self.peak = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _descendants(root: int) -> list[int]:
    """root and every process below it, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, ()))
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def parse_floor(corpus: Path) -> float:
    start = time.perf_counter()
    for path in sorted(glob.glob(str(corpus / "*.tokens.jsonl"))):
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip():
                    try:
                        orjson.loads(line)
                    except orjson.JSONDecodeError:
                        pass  # fault shapes: a corrupt line costs the same to reject
    return time.perf_counter() - start


def fresh_copy(corpus: Path, work: Path, name: str) -> Path:
    target = work / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(corpus, target)
    os.sync()  # the copy's writeback must not land inside the next timed run
    return target


def baseline(corpus: Path, ids: list[str]) -> tuple[float, list[dict]]:
    from raycap.reference import reference_trajectories_for_rollout

    start = time.perf_counter()
    builds = [reference_trajectories_for_rollout(rid, [corpus], parent_search="trie") for rid in ids]
    return time.perf_counter() - start, builds


_FRESH = """
import sys
import raycap
from raycap.cluster.rebuild import connect
connect(num_cpus={cpus})
table = raycap.rebuild([{corpus!r}])
print(table.num_rows, flush=True)
"""


def fresh_process(corpus: Path, cpus: int) -> tuple[float, float]:
    """(seconds until the rows are back, seconds until the process has exited)."""
    start = time.perf_counter()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    child = subprocess.Popen(
        [sys.executable, "-c", _FRESH.format(cpus=cpus, corpus=str(corpus))],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    line = child.stdout.readline()
    rows_back = time.perf_counter() - start
    child.stdout.read()
    if child.wait() != 0 or not line.strip().isdigit():
        raise RuntimeError(f"the fresh-process rebuild failed (exit {child.returncode})")
    return rows_back, time.perf_counter() - start


def _comparable(build: dict) -> dict:
    build = dict(build)
    snapshot = build.pop("_capture_snapshot", None)
    build["_version"] = snapshot["version"] if snapshot else None
    if build.get("error"):
        build["error"] = build["error"].split(":", 1)[0]  # texts name their own copy's path
    return build


def corpus_mb(corpus: Path) -> float:
    return sum(os.path.getsize(p) for p in glob.glob(str(corpus / "*.tokens.jsonl"))) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-share", type=float, default=0.1)
    parser.add_argument("--repeat", type=int, default=3, help="repeats of (a), (c) and (d); medians are reported")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--long-calls", type=int, default=1000)
    parser.add_argument("--work", type=Path, default=Path("out/bench"))
    parser.add_argument("--skip-baseline", action="store_true", help="skip (b), the slow one")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # fault shapes log a warning per masked rollout
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    work = args.work.resolve()
    corpus = work / f"corpus-{args.rollouts}-{args.seed}-{args.fault_share}"
    if not corpus.exists():
        print(f"generating corpus in {corpus} ...", flush=True)
        generate_corpus(corpus, CorpusSpec(rollouts=args.rollouts, seed=args.seed, fault_share=args.fault_share))
    long_dir = work / f"long-{args.long_calls}"
    if not long_dir.exists():
        long_rollout(long_dir, calls=args.long_calls)
    from raycap.store import TokenCaptureStore

    ids = TokenCaptureStore(corpus, create=False).rollout_ids()
    mb = corpus_mb(corpus)
    print(f"corpus: {len(ids)} rollouts, {mb:.1f} MB of JSONL; {args.cpus} CPUs for Ray; repeats {args.repeat}")

    results: dict[str, float] = {}
    peaks: dict[str, int] = {}

    floor_times = [parse_floor(corpus) for _ in range(args.repeat)]
    results["a"] = statistics.median(floor_times)

    fresh_times, fresh_exits = [], []
    for i in range(args.repeat):
        rows_back, exited = fresh_process(fresh_copy(corpus, work, "copy-d"), args.cpus)
        fresh_times.append(rows_back)
        fresh_exits.append(exited)
    results["d"] = statistics.median(fresh_times)

    import raycap
    from raycap.cluster.rebuild import connect

    connect(num_cpus=args.cpus)
    warm = fresh_copy(long_dir, work, "copy-warm")
    raycap.rebuild([str(warm)])  # starts the workers and this node's actor
    rebuild_times = []
    table = None
    with PeakMemory() as peak:
        for i in range(args.repeat):
            copy = fresh_copy(corpus, work, f"copy-c{i}")
            start = time.perf_counter()
            table = raycap.rebuild([str(copy)])
            rebuild_times.append(time.perf_counter() - start)
    peaks["c"] = peak.peak
    results["c"] = statistics.median(rebuild_times)

    long_copy = fresh_copy(long_dir, work, "copy-long-c")
    start = time.perf_counter()
    long_table = raycap.rebuild([str(long_copy)])
    long_c = time.perf_counter() - start
    from raycap.consumer import trajectories_for_rollout

    long_local = fresh_copy(long_dir, work, "copy-long-local")
    start = time.perf_counter()
    long_build = trajectories_for_rollout("long-0", [long_local])
    long_fast = time.perf_counter() - start

    identical = None
    if not args.skip_baseline:
        with PeakMemory() as peak:
            results["b"], reference_builds = baseline(fresh_copy(corpus, work, "copy-b"), ids)
        peaks["b"] = peak.peak
        ours = raycap.builds_from_table(table)
        identical = [_comparable(b) for b in ours] == [_comparable(b) for b in reference_builds]
        from raycap.reference import reference_trajectories_for_rollout

        long_ref_copy = fresh_copy(long_dir, work, "copy-long-b")
        start = time.perf_counter()
        long_ref = reference_trajectories_for_rollout("long-0", [long_ref_copy], parent_search="trie")
        long_b = time.perf_counter() - start
        long_same = _comparable(long_ref) == _comparable(raycap.builds_from_table(long_table)[0]) == _comparable(long_build)

    def mbps(seconds: float) -> str:
        return f"{mb / seconds:8.1f} MB/s"

    print()
    print(f"(a) parse floor, 1 core      {results['a']:8.2f} s {mbps(results['a'])}   runs {[round(t, 2) for t in floor_times]}")
    if "b" in results:
        print(f"(b) reference consumer       {results['b']:8.2f} s {mbps(results['b'])}   peak {peaks['b'] / 2**20:.0f} MiB")
    print(f"(c) raycap.rebuild, warm Ray {results['c']:8.2f} s {mbps(results['c'])}   runs {[round(t, 2) for t in rebuild_times]}   peak {peaks['c'] / 2**20:.0f} MiB (driver + Ray)")
    print(f"(d) fresh process + Ray      {results['d']:8.2f} s {mbps(results['d'])}   runs {[round(t, 2) for t in fresh_times]}"
          f"   (until the process exited, Ray shutdown included: median {statistics.median(fresh_exits):.2f} s)")
    print()
    if "b" in results:
        print(f"b/c = {results['b'] / results['c']:6.1f}x   (target >= 25)")
        print(f"b/d = {results['b'] / results['d']:6.1f}x   (target >= 8)")
    print(f"c/a = {results['c'] / results['a']:6.2f}x   (target <= 2)")
    if identical is not None:
        print(f"builds identical (b) vs (c): {'yes' if identical else 'NO'}")
    print()
    print(f"long rollout ({args.long_calls} calls, {corpus_mb(long_dir):.1f} MB): rebuild {long_c:.2f} s, "
          f"local consumer {long_fast:.2f} s" + (f", reference {long_b:.2f} s, identical: {'yes' if long_same else 'NO'}" if not args.skip_baseline else ""))
    ok = identical is not False and (args.skip_baseline or long_same)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
