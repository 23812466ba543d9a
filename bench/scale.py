"""Benchmark of the driver's cost per node: how a training step's driver CPU grows with the cluster.

Run: `python -m bench.scale` (options: `--help`). It starts a simulated cluster of its
own (`ray.cluster_utils.Cluster`): a head node, where this process is the driver, and
worker nodes of one CPU each, added as the run goes (1, 2, 4, 8 by default). Each worker
node has its own capture directory, given as `NODE_ID:/path`. At each node count:

  rebuild_refs  a warm training step: 8 never-frozen rollouts per node are written, then
                one kept `Rebuilder(...).rebuild_refs(ids)` builds them with the rows kept
                on Ray, and the driver waits until every batch is built (ray.wait; the rows
                are fetched and checked after the timing)
  stream        a warm step of a `raycap.Stream(..., watch=True)` over the same nodes'
                directories: a finalizer process (every node's finalizer, in effect) writes
                and freezes 8 new rollouts per node, all directories at once; once the
                stream has built them all ahead, the driver takes them (`take_refs(n)`)
                and commits them as one step dataset. Two series: the whole
                step, from before the finalizer is told to freeze until the commit returned
                (the stream's discovery and building ahead included), and take + commit
                alone

The cost is the driver process's CPU (user + sys, `time.process_time`, every thread of
the process, Ray's own included) over the step, the median over `--steps` steps after
`--warm` untimed ones. It prints the medians per node count, their least-squares slope
in ms per node, and whether the slope is at most the target (1 ms per node).

Then the stream's latency over `--latency-nodes` nodes' directories (3 by default): a
finalizer process freezes rollouts round-robin on them at a steady rate, a taker waiting
in `take(1)` stamps each arrival, and a committer thread commits every 8 taken
rollouts as a step (as `bench.stream` does); it prints freeze -> take p50 and p99
(targets: 100 ms and 500 ms).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.step import remove_rollouts, write_rollouts

PER_NODE = 8
TARGET_MS_PER_NODE = 1.0
NODE_OBJECT_STORE_BYTES = 100 << 20


@dataclass
class Series:
    name: str
    cpu_ms: dict[int, float] = field(default_factory=dict)  # nodes -> median driver CPU per step
    wall_ms: dict[int, float] = field(default_factory=dict)
    note: str = ""

    def slope(self) -> float | None:
        if len(self.cpu_ms) < 2:
            return None
        nodes = sorted(self.cpu_ms)
        return float(np.polyfit(nodes, [self.cpu_ms[n] for n in nodes], 1)[0])


def _sized(prompt_tokens: int) -> None:
    """Rollouts of `prompt_tokens` prompt tokens per call (bench.step writes them)."""
    import bench.step

    bench.step.PROMPT_TOKENS = prompt_tokens


def _freezer(inbox, outbox, prompt_tokens: int) -> None:
    """The finalizer process: for each (directory, ids) list it gets, writes and freezes
    those rollouts, as each node's writers and finalizer would: every directory at once,
    as every node would."""
    from concurrent.futures import ThreadPoolExecutor

    from raycap.capture.store import TokenCaptureStore

    _sized(prompt_tokens)

    def finish(job: tuple[str, list[str], int]) -> None:
        directory, ids, seed = job
        write_rollouts(Path(directory), ids, np.random.default_rng(seed))
        TokenCaptureStore(directory, create=False).freeze_many(ids, read=False)

    with ThreadPoolExecutor(max_workers=16) as pool:
        while True:
            job = inbox.get()
            if job is None:
                return
            list(pool.map(finish, [(d, ids, k) for k, (d, ids) in enumerate(job)]))
            outbox.put(True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.args = args
        self.root = Path(tempfile.mkdtemp(prefix="raycap-bench-scale-", dir=args.tmp))
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1, "include_dashboard": False, "object_store_memory": NODE_OBJECT_STORE_BYTES,
                "labels": {"raycap-node": "head"},
            },
        )
        ray.init(address=self.cluster.address, logging_level=logging.WARNING)
        self.nodes: list[str] = []  # worker node ids, in the order added
        self.rng = np.random.default_rng(args.seed)
        self.tag = 0

    def grow(self, count: int) -> None:
        while len(self.nodes) < count:
            node = self.cluster.add_node(
                num_cpus=1, object_store_memory=NODE_OBJECT_STORE_BYTES, labels={"raycap-node": f"n{len(self.nodes)}"},
            )
            self.cluster.wait_for_nodes()
            self.nodes.append(node.node_id)
            (self.root / f"n{len(self.nodes) - 1}").mkdir()

    def dirs(self, count: int) -> list[Path]:
        return [self.root / f"n{i}" for i in range(count)]

    def specs(self, count: int) -> list[str]:
        return [f"{node}:{d}" for node, d in zip(self.nodes[:count], self.dirs(count))]

    def step_ids(self, count: int, kind: str) -> list[list[str]]:
        self.tag += 1
        return [[f"{kind}{self.tag}-{i}-{j}" for j in range(PER_NODE)] for i in range(count)]

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- rebuild_refs ---------------------------------------------------------------------

    def refs_steps(self, count: int) -> tuple[list[float], list[float]]:
        import ray

        import raycap

        rebuilder = raycap.Rebuilder(self.specs(count), executor="ray")
        cpu, wall = [], []
        for step in range(self.args.warm + self.args.steps):
            per_node = self.step_ids(count, "r")
            for d, ids in zip(self.dirs(count), per_node):
                write_rollouts(d, ids, self.rng)
            ids = [rid for node_ids in per_node for rid in node_ids]
            started, clock = time.process_time(), time.perf_counter()
            refs = rebuilder.rebuild_refs(ids)
            ray.wait(refs, num_returns=len(refs), fetch_local=False)
            spent, took = time.process_time() - started, time.perf_counter() - clock
            table = _concat(ray.get(refs))
            _check(f"rebuild_refs over {count} nodes", table, ids)
            for d, node_ids in zip(self.dirs(count), per_node):
                remove_rollouts(d, node_ids)
            if step >= self.args.warm:
                cpu.append(spent * 1e3)
                wall.append(took * 1e3)
        return cpu, wall

    # -- the stream -----------------------------------------------------------------------

    def stream_steps(self, count: int) -> tuple[list[float], list[float], list[float]]:
        """Per step: the driver's CPU from telling the finalizer to freeze until the commit
        returned, the same for take + commit alone (started once every rollout is built
        ahead), and the step's wall time."""
        import ray

        import raycap

        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        finalizer = ctx.Process(target=_freezer, args=(inbox, outbox, self.args.prompt_tokens), daemon=True)
        finalizer.start()
        steps = self.root / f"steps-{count}"
        steps.mkdir()
        whole, taking, wall = [], [], []
        try:
            with raycap.Stream(self.specs(count), watch=True, executor="ray") as stream:
                for step in range(self.args.warm + self.args.steps):
                    per_node = self.step_ids(count, "s")
                    ids = [rid for node_ids in per_node for rid in node_ids]
                    started, clock = time.process_time(), time.perf_counter()
                    inbox.put([(str(d), node_ids) for d, node_ids in zip(self.dirs(count), per_node)])
                    deadline = time.monotonic() + 120
                    # A read of the stream's queue, for this report only: take + commit are
                    # timed once every rollout of the step is built ahead.
                    while len(stream._built) < len(ids):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"the stream built {len(stream._built)} of {len(ids)} rollouts in 120 s")
                        time.sleep(0.002)
                    took = time.process_time()
                    taken = stream.take_refs(len(ids), timeout=60)
                    report = stream.commit(taken, output=steps / f"step-{step:04d}")
                    ended, seconds = time.process_time(), time.perf_counter() - clock
                    outbox.get(timeout=60)
                    if report.rollouts != len(ids) or report.retired != len(ids):
                        raise RuntimeError(f"stream step over {count} nodes: {report}")
                    table = _concat(ray.get(taken))
                    _check(f"stream over {count} nodes", table, sorted(ids), ordered=False)
                    if step >= self.args.warm:
                        whole.append((ended - started) * 1e3)
                        taking.append((ended - took) * 1e3)
                        wall.append(seconds * 1e3)
        finally:
            inbox.put(None)
            finalizer.join(timeout=30)
        return whole, taking, wall


def _trickle(jobs: list[tuple[str, str]], rate: float, frozen, prompt_tokens: int) -> None:
    """The finalizer process of the latency part: writes and freezes each (directory,
    rollout) at a steady rate, and stamps when each freeze returned."""
    from raycap.capture.store import TokenCaptureStore

    _sized(prompt_tokens)
    rng = np.random.default_rng(11)
    started = time.monotonic()
    for i, (directory, rid) in enumerate(jobs):
        write_rollouts(Path(directory), [rid], rng)
        TokenCaptureStore(directory, create=False).freeze_raw(rid, read=False)
        frozen.put((rid, time.time()))
        wait = started + (i + 1) / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    frozen.put(None)


def latency(bench: Bench, count: int, rollouts: int, rate: float) -> list[float]:
    """Freeze -> take latencies (ms) of a taker waiting in take(1), over `count` nodes'
    directories, the rollouts frozen round-robin on them at `rate` per second while a
    committer thread commits every 8 taken rollouts as one step (as `bench.stream`)."""
    import threading

    import pyarrow as pa

    import raycap

    bench.tag += 1
    jobs = [(str(d), f"l{bench.tag}-{i}") for i in range(rollouts) for d in [bench.dirs(count)[i % count]]]
    steps = bench.root / f"latency-steps-{bench.tag}"
    steps.mkdir()
    ctx = mp.get_context("spawn")
    frozen = ctx.Queue()
    arrived: dict[str, float] = {}
    taken: list = []
    ready = threading.Condition()
    done = threading.Event()
    with raycap.Stream(bench.specs(count), watch=True, executor="ray") as stream:

        def commit_steps() -> None:
            step = 0
            while True:
                with ready:
                    ready.wait_for(lambda: len(taken) >= 8 or done.is_set())
                    batch, taken[:] = taken[:8], taken[8:]
                if not batch:
                    return
                stream.commit(pa.concat_tables(batch), output=steps / f"step-{step:05d}")
                step += 1

        committer = threading.Thread(target=commit_steps, daemon=True)
        committer.start()
        finalizer = ctx.Process(target=_trickle, args=(jobs, rate, frozen, bench.args.prompt_tokens), daemon=True)
        finalizer.start()
        while len(arrived) < rollouts:
            rows = stream.take(1, timeout=60)
            now = time.time()
            if not rows.num_rows:
                raise RuntimeError(f"no rollout arrived for 60 s ({len(arrived)} of {rollouts} so far)")
            arrived[rows.column("rollout_id")[0].as_py()] = now
            with ready:
                taken.append(rows)
                ready.notify_all()
        done.set()
        with ready:
            ready.notify_all()
        committer.join()
        stamps = {}
        while (item := frozen.get(timeout=60)) is not None:
            stamps[item[0]] = item[1]
        finalizer.join(timeout=30)
    return [(arrived[rid] - stamps[rid]) * 1e3 for rid in stamps]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _concat(tables):
    import pyarrow as pa

    return pa.concat_tables(list(tables))


def _check(what: str, table, ids: list[str], *, ordered: bool = True) -> None:
    got = table.column("rollout_id").to_pylist()
    if not ordered:
        got = sorted(got)
    masked = sum(bool(m) for m in table.column("mask_sample").to_pylist())
    if got != ids or masked:
        errors = {e for e in table.column("error").to_pylist() if e}
        raise RuntimeError(f"{what}: {len(got)} rows for {len(ids)} ids, {masked} masked ({sorted(errors)[:2]})")


SERIES = {
    "rebuild_refs": ("rebuild_refs",),
    "stream": ("stream step (freeze to commit)", "stream take + commit"),
}


def run(args: argparse.Namespace) -> dict[str, Series]:
    counts = sorted({int(c) for c in args.nodes.split(",")})
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    series = {name: Series(name) for part in parts for name in SERIES[part]}
    bench = Bench(args)
    try:
        for count in counts:
            bench.grow(count)
            for part in parts:
                names = SERIES[part]
                if series[names[0]].note:
                    continue
                try:
                    if part == "rebuild_refs":
                        *cpus, wall = bench.refs_steps(count)
                    else:
                        *cpus, wall = bench.stream_steps(count)
                except (ValueError, TypeError) as exc:  # a code base whose stream refuses node directories
                    for name in names:
                        series[name].note = f"refused: {str(exc)[:160]}"
                    print(f"{part:>12} over {count} nodes: {series[names[0]].note}", flush=True)
                    continue
                for name, cpu in zip(names, cpus):
                    series[name].cpu_ms[count] = statistics.median(cpu)
                    series[name].wall_ms[count] = statistics.median(wall)
                    print(
                        f"{name} over {count} nodes: driver CPU per step median {statistics.median(cpu):6.2f} ms "
                        f"(min {min(cpu):.2f}, max {max(cpu):.2f}; {len(cpu)} steps), wall median "
                        f"{statistics.median(wall):6.1f} ms",
                        flush=True,
                    )
        if args.latency_rollouts and "stream" in parts and not series[SERIES["stream"][0]].note:
            count = min(args.latency_nodes, max(counts))
            bench.grow(count)
            values = latency(bench, count, args.latency_rollouts, args.latency_rate)
            print(
                f"freeze -> take over {count} nodes' directories ({len(values)} rollouts at {args.latency_rate:g}/s, "
                f"a taker waiting in take(1), a committer committing every 8): p50 {_percentile(values, 0.5):.1f} ms, "
                f"p99 {_percentile(values, 0.99):.1f} ms, max {max(values):.1f} ms (targets: p50 <= 100 ms, "
                "p99 <= 500 ms)",
                flush=True,
            )
    finally:
        bench.close()
    report(series, counts)
    return series


def report(series: dict[str, Series], counts: list[int]) -> None:
    print()
    print("| driver CPU per step (median) | " + " | ".join(f"{c} node{'s' * (c > 1)}" for c in counts) + " | slope |")
    print("|---|" + "---|" * (len(counts) + 1))
    for s in series.values():
        if s.note:
            print(f"| {s.name} | " + " | ".join("-" for _ in counts) + f" | {s.note} |")
            continue
        slope = s.slope()
        cells = " | ".join(f"{s.cpu_ms[c]:.2f} ms" for c in counts)
        verdict = "" if slope is None else f"{slope:.2f} ms/node ({'met' if slope <= TARGET_MS_PER_NODE else 'NOT MET'})"
        print(f"| {s.name} | {cells} | {verdict} |")
    print(f"(target: at most {TARGET_MS_PER_NODE:.0f} ms of driver CPU per added node; {PER_NODE} rollouts per node per step)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,2,4,8", help="node counts, comma-separated")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per node count and part")
    parser.add_argument("--warm", type=int, default=3, help="untimed steps first")
    parser.add_argument("--only", default="rebuild_refs,stream", help="parts: rebuild_refs, stream")
    parser.add_argument("--latency-nodes", type=int, default=3, help="nodes of the stream's latency run")
    parser.add_argument("--latency-rollouts", type=int, default=120, help="rollouts of the latency run (0: none)")
    parser.add_argument("--latency-rate", type=float, default=20.0, help="rollouts frozen per second, over all nodes")
    parser.add_argument("--prompt-tokens", type=int, default=120,
                        help="prompt tokens of each call of the two-call rollouts (bench.step; 20000: about 280 KB each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmp", default=None, help="where the directories go (default: the system temp)")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logging.getLogger("raycap").setLevel(logging.ERROR)
    args = parser.parse_args(argv)
    _sized(args.prompt_tokens)
    print(f"{PER_NODE} two-call rollouts per node per step, {args.prompt_tokens} prompt tokens per call", flush=True)
    run(args)


if __name__ == "__main__":
    main()
