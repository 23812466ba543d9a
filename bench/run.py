"""Benchmark: raycap's rebuild against the JSON parse floor and a straightforward consumer.

One run measures every part on the same generated corpus (each contender on its own
copy, because the first freeze writes state), interleaving the contenders round by
round, so that its ratios compare runs made under the same machine load (the machine
may be shared):

  floor      (a) read + orjson.loads of every JSONL line, one core: the parse floor
  reference  (b) the straightforward per-rollout consumer: pydantic records, the
             reference builder with a token-trie parent search, sequentially
  warm       (c) raycap.rebuild(executor="ray") on the Ray started here (warm workers)
  fresh      (d) a new Python process that starts Ray (connect) and rebuilds
  cold       a fresh process that starts Ray (connect), then times its first
             raycap.rebuild and two warm ones on other copies, with the default
             executor (auto) and with executor ray (what Ray alone gives)
  e2e        a fresh process doing only `import raycap; raycap.rebuild([dir],
             executor=E)`, for E in auto, local, ray: until the rows and until exit
  driver     the rebuild job (`python -m jobs.rebuild --config`) joined to a 2-CPU
             `ray start` head of its own: the driver process's CPU beyond an empty
             run (1 tiny rollout), over the CPU of a one-core in-process build
             (executor local), and the driver's peak RSS at 1x and 4x the corpus
  long       one rollout of ~1,000 calls: rebuild, local consumer, reference
  step       a training step of 64 never-frozen ids from directories holding 500 and
             20,000 small rollouts, a kept Rebuilder against the sequential reference
             consumer per rollout, interleaved step by step (bench/step.py); with
             `--base DIR`, another checkout's Rebuilder too, in the same steps, each
             tree's in a process of its own with its own embedded Ray

Order: this process starts its embedded Ray first (when warm, long or step is asked
for) and keeps it, idle while the others run. Then floor, reference, warm, fresh, cold
and e2e run in rounds (`--repeat`), each round in a rotated order; then the driver part,
in rounds of its own against its head; then long and step on the embedded Ray. It
prints medians, the ratios the performance targets are stated in (each with its target
and whether it is met), peak memory, and correctness checks: (b) and (c) give identical
builds, every run returns every row, every step row is unmasked. Generated inputs are
cached in the work directory; the copies a run makes are removed at its end.

    python -m bench [--rollouts 120] [--repeat 3] [--cpus 2] [--work DIR]
                [--only floor,reference,warm,fresh,long,step,cold,e2e,driver]
                [--step-sizes 500,20000] [--steps 15] [--base DIR]
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import orjson

from bench.proc import (
    HeadUnavailable,
    RayHead,
    end_to_end,
    first_call,
    fresh_copy,
    fresh_process,
    local_cpu,
    run_job,
)
from bench.step import history_dir, reference_oracle, run_steps, write_rollouts
from raycap.cli.synth import CorpusSpec, generate_corpus, long_rollout

PARTS = ("floor", "reference", "warm", "fresh", "long", "step", "cold", "e2e", "driver")
EXECUTORS = ("auto", "local", "ray")


class PeakMemory:
    """Peak RSS of this process plus, with `tree`, all its descendants (the embedded Ray), sampled."""

    def __init__(self, interval: float = 0.05, *, tree: bool = True):
        self.interval, self.tree = interval, tree
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        pids = _descendants(os.getpid()) if self.tree else [os.getpid()]
        return sum(_rss(pid) for pid in pids)

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


def baseline(corpus: Path, ids: list[str]) -> tuple[float, list[dict]]:
    reference_trajectories_for_rollout = reference_oracle().reference_trajectories_for_rollout

    start = time.perf_counter()
    builds = [reference_trajectories_for_rollout(rid, [corpus], parent_search="trie") for rid in ids]
    return time.perf_counter() - start, builds


def _comparable(build: dict) -> dict:
    build = dict(build)
    snapshot = build.pop("_capture_snapshot", None)
    build["_version"] = snapshot["version"] if snapshot else None
    if build.get("error"):
        build["error"] = build["error"].split(":", 1)[0]  # texts name their own copy's path
    return build


def corpus_mb(corpus: Path) -> float:
    return sum(os.path.getsize(p) for p in glob.glob(str(corpus / "*.tokens.jsonl"))) / 1e6


def ensure_corpus(work: Path, rollouts: int, seed: int, fault_share: float) -> Path:
    corpus = work / f"corpus-{rollouts}-{seed}-{fault_share}"
    if not corpus.exists():
        print(f"generating corpus in {corpus} ...", flush=True)
        partial = work / f".{corpus.name}.partial"
        if partial.exists():
            shutil.rmtree(partial)
        generate_corpus(partial, CorpusSpec(rollouts=rollouts, seed=seed, fault_share=fault_share))
        partial.rename(corpus)
    return corpus


def med(values: list[float]) -> float:
    return statistics.median(values)


def runs(values: list[float], digits: int = 2) -> str:
    return str([round(v, digits) for v in values])


class Report:
    """The ratio lines, each with its target and whether it is met."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.unmet: list[str] = []

    def ratio(self, name: str, value: float, target: str, met: bool | None, note: str = "") -> None:
        verdict = "" if met is None else ("met" if met else "NOT MET")
        self.lines.append(f"  {name:<46} {value:8.2f}   target {target:<14} {verdict:<8} {note}".rstrip())
        if met is False:
            self.unmet.append(name)


def _rounds(repeat: int, contenders: list[tuple[str, Callable[[int], None]]], label: str) -> None:
    """Run every contender once per round, in an order that rotates from round to round."""
    for r in range(repeat):
        k = r % len(contenders) if contenders else 0
        for name, run in contenders[k:] + contenders[:k]:
            print(f"  [{label} round {r + 1}/{repeat}] {name} ...", flush=True)
            run(r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-share", type=float, default=0.1)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of every batch part; medians are reported")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--long-calls", type=int, default=1000)
    parser.add_argument("--work", type=Path, default=Path("out/bench"))
    parser.add_argument("--skip-baseline", action="store_true", help="skip (b), the slow one (and the ratios against it)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run, of: {','.join(PARTS)}")
    parser.add_argument("--step-sizes", default="500,20000", help="rollouts of history in the step directories")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per contender (after one warm-up step)")
    parser.add_argument("--step-ids", type=int, default=64, help="rollout ids per step")
    parser.add_argument(
        "--base", default=None,
        help="the step part also times this checkout's Rebuilder (the code before a change, say) in the same steps",
    )
    parser.add_argument("--scale", type=int, default=4, help="the larger corpus of the driver part, in corpora")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    if args.skip_baseline:
        parts.discard("reference")
    logging.disable(logging.WARNING)  # fault shapes log a warning per masked rollout
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.perf_counter()

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpus = ensure_corpus(work, args.rollouts, args.seed, args.fault_share)
    long_dir = work / f"long-{args.long_calls}"
    if parts & {"warm", "long"} and not long_dir.exists():
        long_rollout(long_dir, calls=args.long_calls)
    from raycap.capture.store import TokenCaptureStore

    ids = TokenCaptureStore(corpus, create=False).rollout_ids()
    mb = corpus_mb(corpus)
    print(f"corpus: {len(ids)} rollouts, {mb:.1f} MB of JSONL; {args.cpus} CPUs for Ray; repeats {args.repeat}; "
          f"parts {','.join(p for p in PARTS if p in parts)}", flush=True)

    t: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    notes: list[str] = []
    problems: list[str] = []
    kept: dict[str, object] = {}

    # -- one embedded Ray in this process, for (c), long and step; idle while others run --------
    raycap = None
    # (With --base, the step's Rebuilders run in processes of their own: bench/step.py.)
    if parts & {"warm", "long"} or ("step" in parts and not args.base):
        import raycap
        from raycap.cluster.rebuild.session import connect

        start = time.perf_counter()
        connect(num_cpus=args.cpus)
        t["ray start here"] = [time.perf_counter() - start]
        if parts & {"warm", "long"}:
            raycap.rebuild([str(fresh_copy(long_dir, work, "copy-warm"))], executor="ray")  # starts workers, actor

    # -- batch parts, interleaved round by round -----------------------------------------------
    def floor(_r: int) -> None:
        t.setdefault("a", []).append(parse_floor(corpus))

    def reference(_r: int) -> None:
        kept.pop("reference_builds", None)
        copy = fresh_copy(corpus, work, "copy-b")
        with PeakMemory(tree=False) as peak:
            seconds, builds = baseline(copy, ids)
        t.setdefault("b", []).append(seconds)
        peaks["b"] = max(peaks.get("b", 0), peak.peak)
        kept["reference_builds"] = builds

    def warm(r: int) -> None:
        copy = fresh_copy(corpus, work, "copy-c")
        with PeakMemory() as peak:
            start = time.perf_counter()
            table = raycap.rebuild([str(copy)], executor="ray")
            t.setdefault("c", []).append(time.perf_counter() - start)
        peaks["c"] = max(peaks.get("c", 0), peak.peak)
        kept["warm table"] = table
        if table.num_rows != len(ids):
            problems.append(f"(c): {table.num_rows} rows, expected {len(ids)}")

    def fresh(_r: int) -> None:
        rows_back, exited = fresh_process(fresh_copy(corpus, work, "copy-d"), args.cpus)
        t.setdefault("d", []).append(rows_back)
        t.setdefault("d exit", []).append(exited)

    def cold(executor: str) -> Callable[[int], None]:
        def run(_r: int) -> None:
            copies = [fresh_copy(corpus, work, f"copy-first-{i}") for i in range(3)]
            out = first_call(copies, args.cpus, executor)
            t.setdefault(f"first {executor}", []).append(out.first)
            t.setdefault(f"warm {executor}", []).extend(out.warm)
            t.setdefault(f"ray start {executor}", []).append(out.ray_start)
            kept[f"cold executors {executor}"] = out.executors
            if any(rows != len(ids) for rows in out.rows):
                problems.append(f"first-call run ({executor}): rows {out.rows}, expected {len(ids)}")
        return run

    def e2e(executor: str) -> Callable[[int], None]:
        def run(_r: int) -> None:
            out = end_to_end(fresh_copy(corpus, work, "copy-e2e"), executor)
            t.setdefault(f"e2e {executor}", []).append(out.rows_back)
            t.setdefault(f"e2e {executor} exit", []).append(out.exited)
            kept[f"e2e executor {executor}"] = out.executor
            if out.rows != len(ids):
                problems.append(f"end-to-end run ({executor}): {out.rows} rows, expected {len(ids)}")
        return run

    batch: list[tuple[str, Callable[[int], None]]] = []
    if "floor" in parts:
        batch.append(("(a) parse floor", floor))
    if "reference" in parts:
        batch.append(("(b) reference consumer", reference))
    if "warm" in parts:
        batch.append(("(c) rebuild on the warm Ray", warm))
    if "fresh" in parts:
        batch.append(("(d) fresh process", fresh))
    if "cold" in parts:
        batch += [(f"first call, executor {e}", cold(e)) for e in ("auto", "ray")]
    if "e2e" in parts:
        batch += [(f"end to end, executor {e}", e2e(e)) for e in EXECUTORS]
    if batch:
        print("batch parts, in rounds:", flush=True)
        _rounds(args.repeat, batch, "batch")

    # -- the driver's share, against a head of its own ---------------------------------------
    driver: dict[str, list] = {}
    if "driver" in parts:
        large = ensure_corpus(work, args.scale * args.rollouts, args.seed, args.fault_share)
        expected = {
            "1x": len(TokenCaptureStore(corpus, create=False).rollout_ids(skip_retired=True)),
            "Nx": len(TokenCaptureStore(large, create=False).rollout_ids(skip_retired=True)),
        }
        kept["large mb"] = corpus_mb(large)

        def tiny() -> Path:
            directory = work / "driver-empty"
            if directory.exists():
                shutil.rmtree(directory)
            directory.mkdir()
            write_rollouts(directory, ["tiny-0"], np.random.default_rng(0))
            return directory

        def driver_rounds(head: RayHead | None) -> None:
            run_job(head, tiny(), work, "driver-warmup", args.cpus)  # the head's workers start here

            def job(name: str, source: Callable[[], Path], rows: int | None) -> Callable[[int], None]:
                def run(_r: int) -> None:
                    out = run_job(head, source(), work, f"driver-{name}", args.cpus)
                    driver.setdefault(name, []).append(out)
                    if rows is not None and out.rows != rows:
                        problems.append(f"rebuild job ({name}): {out.rows} rows, expected {rows}")
                return run

            def build_here(name: str, source: Path, rows: int) -> Callable[[int], None]:
                def run(_r: int) -> None:
                    cpu, wall, got = local_cpu(fresh_copy(source, work, f"copy-local-{name}"))
                    driver.setdefault(f"local cpu {name}", []).append(cpu)
                    driver.setdefault(f"local wall {name}", []).append(wall)
                    if got != rows:
                        problems.append(f"in-process build ({name}): {got} rows, expected {rows}")
                return run

            everything = {k: len(TokenCaptureStore(c, create=False).rollout_ids()) for k, c in (("1x", corpus), ("Nx", large))}
            _rounds(args.repeat, [
                ("job on 1 tiny rollout (empty run)", job("empty", tiny, 1)),
                ("job on the corpus", job("1x", lambda: fresh_copy(corpus, work, "copy-job"), expected["1x"])),
                (f"job on {args.scale}x the corpus", job("Nx", lambda: fresh_copy(large, work, "copy-job-large"), expected["Nx"])),
                ("one-core in-process build of the corpus", build_here("1x", corpus, everything["1x"])),
                (f"one-core in-process build of {args.scale}x the corpus", build_here("Nx", large, everything["Nx"])),
            ], "driver")

        print(f"driver part: starting a {args.cpus}-CPU head (ray start --head) ...", flush=True)
        try:
            with RayHead(args.cpus) as head:
                driver_rounds(head)
            kept["driver ray"] = f"joined to a {args.cpus}-CPU `ray start` head"
        except HeadUnavailable as exc:
            notes.append(f"{exc}; the driver part ran the job on an embedded Ray and counted the driver process alone")
            kept["driver ray"] = f"on an embedded {args.cpus}-CPU Ray (no `ray start` head here)"
            driver_rounds(None)

    # -- on the embedded Ray again: long, step -------------------------------------------------
    step = None
    if "long" in parts:
        from raycap.capture.consumer import trajectories_for_rollout

        long_copy = fresh_copy(long_dir, work, "copy-long-c")
        start = time.perf_counter()
        long_table = raycap.rebuild([str(long_copy)], executor="ray")
        t["long c"] = [time.perf_counter() - start]
        long_local = fresh_copy(long_dir, work, "copy-long-local")
        start = time.perf_counter()
        long_build = trajectories_for_rollout("long-0", [long_local])
        t["long fast"] = [time.perf_counter() - start]
        if "reference" in parts:
            reference_trajectories_for_rollout = reference_oracle().reference_trajectories_for_rollout

            long_ref_copy = fresh_copy(long_dir, work, "copy-long-b")
            start = time.perf_counter()
            long_ref = reference_trajectories_for_rollout("long-0", [long_ref_copy], parent_search="trie")
            t["long b"] = [time.perf_counter() - start]
            same = _comparable(long_ref) == _comparable(raycap.builds_from_table(long_table)[0]) == _comparable(long_build)
            kept["long identical"] = same
            if not same:
                problems.append("the long rollout's builds differ")

    if "step" in parts:
        sizes = [int(s) for s in args.step_sizes.split(",") if s.strip()]
        dirs = {n: history_dir(work, n, args.seed) for n in sizes}
        print(f"step part: {args.steps} steps of {args.step_ids} ids per contender, directories of {sizes} rollouts ...", flush=True)
        step = run_steps(dirs, steps=args.steps, ids_per_step=args.step_ids, seed=args.seed, base=args.base, cpus=args.cpus)
        problems.extend(dict.fromkeys(step.problems))

    if "warm table" in kept and "reference_builds" in kept:
        ours = raycap.builds_from_table(kept["warm table"])
        kept["identical"] = [_comparable(b) for b in ours] == [_comparable(b) for b in kept["reference_builds"]]
        if not kept["identical"]:
            problems.append("(b) and (c) builds differ")

    _print_report(args, parts, mb, t, peaks, driver, step, kept, notes, problems, time.perf_counter() - started)
    _remove_copies(work)
    return 1 if problems else 0


def _remove_copies(work: Path) -> None:
    """Leave only the generated inputs (corpora, step histories, the long rollout) cached."""
    for pattern in ("copy-*", "driver-*"):
        for path in work.glob(pattern):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _print_report(args, parts, mb, t, peaks, driver, step, kept, notes, problems, elapsed) -> None:
    def mbps(seconds: float) -> str:
        return f"{mb / seconds:8.1f} MB/s"

    m = {k: med(v) for k, v in t.items() if v}
    print()
    print(f"== results: {args.repeat} rounds, medians; corpus {mb:.1f} MB ({args.rollouts} rollouts) ==")
    if "a" in m:
        print(f"(a) parse floor, 1 core      {m['a']:8.2f} s {mbps(m['a'])}   runs {runs(t['a'])}")
    if "b" in m:
        print(f"(b) reference consumer       {m['b']:8.2f} s {mbps(m['b'])}   runs {runs(t['b'])}   peak {peaks['b'] / 2**20:.0f} MiB (this process)")
    if "c" in m:
        print(f"(c) raycap.rebuild, warm Ray {m['c']:8.2f} s {mbps(m['c'])}   runs {runs(t['c'])}   peak {peaks['c'] / 2**20:.0f} MiB (driver + Ray)")
    if "ray start here" in m:
        print(f"    (the Ray of (c) started in {m['ray start here']:.2f} s, before the rounds)")
    if "d" in m:
        print(f"(d) fresh process + Ray      {m['d']:8.2f} s {mbps(m['d'])}   runs {runs(t['d'])}"
              f"   (until the process exited, Ray shutdown included: {m['d exit']:.2f} s)")
    if "long c" in m:
        line = f"long rollout ({args.long_calls} calls): rebuild {m['long c']:.2f} s, local consumer {m['long fast']:.2f} s"
        if "long b" in m:
            line += f", reference {m['long b']:.2f} s, identical: {'yes' if kept['long identical'] else 'NO'}"
        print(line)

    if step is not None:
        print()
        print(f"step latency: {step.ids_per_step} fresh ids per step, {step.steps} steps per contender, interleaved, medians (ms)")
        for name in step.times:
            low, p90, high = (x * 1000 for x in step.spread(name))
            print(f"  {name:<18} {step.median(name) * 1000:8.1f} ms   min {low:6.1f}  p90 {p90:6.1f}  max {high:6.1f}   "
                  f"runs {runs([x * 1000 for x in step.times[name]], 0)}")

    if "first auto" in m or "first ray" in m:
        print()
        print("first call on a fresh Ray (connect, then raycap.rebuild of three copies; executor of each call):")
        for e in ("auto", "ray"):
            if f"first {e}" in m:
                print(f"  executor {e:<5} first {m[f'first {e}']:6.2f} s   warm {m[f'warm {e}']:6.2f} s   "
                      f"Ray start {m[f'ray start {e}']:5.2f} s   ran {kept[f'cold executors {e}']}   "
                      f"runs first {runs(t[f'first {e}'])} warm {runs(t[f'warm {e}'])}")

    if any(f"e2e {e}" in m for e in EXECUTORS):
        print()
        print("end to end, a fresh process: import raycap; raycap.rebuild([dir], executor=E)")
        for e in EXECUTORS:
            if f"e2e {e}" in m:
                print(f"  executor {e:<5} rows back {m[f'e2e {e}']:6.2f} s   exited {m[f'e2e {e} exit']:6.2f} s   "
                      f"ran {kept[f'e2e executor {e}']}   runs {runs(t[f'e2e {e}'])}")

    share = None
    if driver:
        print()
        cpu = {k: med([r.cpu for r in driver[k]]) for k in ("empty", "1x", "Nx")}
        rss = {k: med([r.max_rss for r in driver[k]]) for k in ("empty", "1x", "Nx")}
        wall = {k: med([r.wall for r in driver[k]]) for k in ("empty", "1x", "Nx")}
        local = {k: med(driver[f"local cpu {k}"]) for k in ("1x", "Nx")}
        share = (cpu["1x"] - cpu["empty"]) / local["1x"]
        print(f"rebuild job {kept['driver ray']}; the driver process's own CPU (user+sys) and peak RSS:")
        for k, label in (("empty", "empty run (1 tiny rollout)"), ("1x", f"corpus ({mb:.0f} MB)"),
                         ("Nx", f"{args.scale}x corpus ({kept['large mb']:.0f} MB)")):
            ran = sorted({r.executor for r in driver[k]})
            print(f"  {label:<28} CPU {cpu[k]:6.2f} s   peak RSS {rss[k] / 2**20:6.0f} MiB   wall {wall[k]:6.2f} s   "
                  f"executor {','.join(ran)}   CPU runs {runs([r.cpu for r in driver[k]])}")
        for k, label in (("1x", "the corpus"), ("Nx", f"{args.scale}x the corpus")):
            print(f"  one-core in-process build of {label}: CPU {local[k]:.2f} s (wall {med(driver[f'local wall {k}']):.2f} s)   "
                  f"CPU runs {runs(driver[f'local cpu {k}'])}")
        print(f"  marginal driver CPU: {cpu['1x'] - cpu['empty']:.2f} s at 1x, {cpu['Nx'] - cpu['empty']:.2f} s at {args.scale}x")
        kept["driver"] = (cpu, rss, local, share)

    report = Report()
    if "b" in m and "c" in m:
        report.ratio("b/c  reference / warm rebuild", m["b"] / m["c"], ">= 25", m["b"] / m["c"] >= 25)
    if "b" in m and "d" in m:
        # (d) starts Ray by calling connect; the ">= 8" of a fresh process is the e2e auto line.
        report.ratio("b/d  reference / fresh process (connect)", m["b"] / m["d"], "(Ray forced)", None)
    if "a" in m and "c" in m:
        report.ratio("c/a  warm rebuild / parse floor", m["c"] / m["a"], "<= 2", m["c"] / m["a"] <= 2)
    if step is not None:
        sizes = [int(s) for s in args.step_sizes.split(",") if s.strip()]
        small, big = min(sizes), max(sizes)
        if small != big:
            growth = step.median(f"raycap {big}") / step.median(f"raycap {small}")
            report.ratio(f"step growth raycap({big}) / raycap({small})", growth, "<= 1.3", growth <= 1.3)
            if args.base:
                growth = step.median(f"base {big}") / step.median(f"base {small}")
                report.ratio(f"step growth base({big}) / base({small})", growth, "(for comparison)", None)
        for n in sorted(sizes):
            # raycap's step at most half the sequential reference's
            ratio = step.median(f"reference {n}") / step.median(f"raycap {n}")
            report.ratio(f"step reference / raycap, {n} rollouts", ratio, ">= 2.0", ratio >= 2.0)
            if args.base:
                ratio = step.median(f"reference {n}") / step.median(f"base {n}")
                report.ratio(f"step reference / base, {n} rollouts", ratio, "(for comparison)", None)
    if "first auto" in m:
        ratio = m["first auto"] / m["warm auto"]
        report.ratio("first call / warm call (executor auto)", ratio, "<= 1.5", ratio <= 1.5,
                     f"(the calls ran {kept['cold executors auto']})")
        if "c" in m:
            report.ratio("first call (auto) / (c) warm Ray", m["first auto"] / m["c"], "<= 1.5", m["first auto"] / m["c"] <= 1.5)
        if "b" in m:
            report.ratio("b / first call (executor auto)", m["b"] / m["first auto"], ">= 25", m["b"] / m["first auto"] >= 25)
    if "first ray" in m:
        report.ratio("first call / warm call (executor ray)", m["first ray"] / m["warm ray"], "(Ray alone)", None)
        if "b" in m:
            report.ratio("b / first call (executor ray)", m["b"] / m["first ray"], "(Ray alone)", None)
    if "b" in m:
        for e in EXECUTORS:
            if f"e2e {e}" in m:
                ratio = m["b"] / m[f"e2e {e}"]
                report.ratio(f"b / fresh process end to end ({e})", ratio, ">= 8" if e == "auto" else "", ratio >= 8 if e == "auto" else None)
    if share is not None:
        cpu, rss, local, share = kept["driver"]
        report.ratio("driver share (marginal driver CPU / build CPU)", share, "<= 0.05", share <= 0.05)
        at_scale = (cpu["Nx"] - cpu["empty"]) / local["Nx"]
        report.ratio(f"driver share at {args.scale}x the corpus", at_scale, "<= 0.05", at_scale <= 0.05)
        growth = rss["Nx"] / rss["1x"]
        report.ratio(f"driver peak RSS {args.scale}x / 1x", growth, "0.8 .. 1.2", 0.8 <= growth <= 1.2)
    print()
    print("ratios (medians of this run):")
    for line in report.lines:
        print(line)
    if "reference" not in parts:
        print("  (the ratios against the reference need part 'reference')")
    if "identical" in kept:
        print(f"builds identical (b) vs (c): {'yes' if kept['identical'] else 'NO'}")
    for note in notes:
        print(f"note: {note}")
    print(f"targets not met: {', '.join(report.unmet) if report.unmet else 'none'}")
    print(f"correctness: {'; '.join(problems) if problems else 'every run returned every row' + (', builds identical' if 'identical' in kept else '')}")
    print(f"benchmark wall time {elapsed / 60:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
