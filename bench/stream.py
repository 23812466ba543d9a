"""Benchmark of streaming for asynchronous training (`raycap.Stream`).

Run: `python -m bench.stream` (options: `--help`). It measures, on one capture directory:

- latency: writer processes append rollouts through the store at a steady rate; a
  finalizer process freezes each as it finishes and stamps the time the freeze
  returned. The stream watches the directory; a taker waits in `take(1)` and stamps
  each rollout's arrival, while a committer thread commits every 64 taken rollouts as
  one step dataset. Reported: freeze -> take latency p50 / p99 over all rollouts.
- throughput: a backlog of frozen rollouts; the stream takes batches of 64 and commits
  each as one step dataset. Reported: rows per second, take to commit.

With `--nodes 1,3` it measures instead the latency of a stream over simulated nodes'
directories (`ray.cluster_utils.Cluster`: a head node, where this process is the
trainer, and worker nodes of one CPU each, each with its own capture directory given as
`NODE_ID:/path`; this process never looks at them). On each node a writer process
copies each rollout's capture in under a temporary name (`.in-<id>.tokens.jsonl`),
renames it into place and freezes it through the store (as Gym's finalizer does), at
`--rates` rollouts per second over all nodes, and stamps the time the freeze returned.
A taker waits in `take(1)` and a committer thread beside it commits every 16 taken
rollouts. Each configuration runs for `--seconds`; p50 and p99 of freeze -> take are
reported per node count and rate (targets: p50 <= 100 ms, p99 <= 500 ms).

Both run on a fresh directory and with `--history` retired rollouts (20,000 by default)
in it, `--repeat` times (3 by default) each on new directories, the rounds alternating
which goes first; the medians are reported, and the growth is history / fresh of them. The tombstones are written directly in the store's format (state file
and retired marker, what `drop` leaves), which is what a long run leaves behind and
much faster than dropping each one. Targets (issue 20): p50 <= 100 ms and p99 <= 500 ms
on a warm 2-CPU Ray, and growth <= 1.3x with the history.

Rollouts are four chained calls: a 120-token prompt, 32 generated tokens per call and
24 tool tokens between calls.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT_TOKENS = 120
GENERATION_TOKENS = 32
TOOL_TOKENS = 24
CALLS = 4
STEP = 64


def _entries(rollout_id: str, seed: int) -> list:
    import random

    from raycap import TokenEntry

    rng = random.Random(seed)
    prompt = [rng.randrange(50_000) for _ in range(PROMPT_TOKENS)]
    out = []
    for index in range(CALLS):
        generation = [rng.randrange(50_000) for _ in range(GENERATION_TOKENS)]
        out.append(
            TokenEntry(
                rollout_id=rollout_id, model_call_id=f"call-{index}", prompt_token_ids=prompt,
                generation_token_ids=generation, generation_log_probs=[-0.5] * GENERATION_TOKENS,
                created_at=float(index), policy_version=index,
            )
        )
        prompt = prompt + generation + [rng.randrange(50_000) for _ in range(TOOL_TOKENS)]
    return out


def _writer(directory: str, prefix: str, count: int, rate: float, finished) -> None:
    """Appends `count` rollouts at `rate` per second, each call spread over its share."""
    from raycap import TokenCaptureStore

    store = TokenCaptureStore(directory)
    started = time.monotonic()
    for i in range(count):
        rollout_id = f"{prefix}{i:06d}"
        for entry in _entries(rollout_id, hash(rollout_id) & 0xFFFF):
            store.append(entry)
        finished.put(rollout_id)
        wait = started + (i + 1) / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    finished.put(None)


def _finalizer(directory: str, writers: int, finished, frozen) -> None:
    """Freezes each rollout as its writer reports it finished; stamps when it was ready."""
    from raycap import TokenCaptureStore

    store = TokenCaptureStore(directory)
    done = 0
    while done < writers:
        rollout_id = finished.get()
        if rollout_id is None:
            done += 1
            continue
        store.freeze_raw(rollout_id, read=False)
        frozen.put((rollout_id, time.time()))
    frozen.put(None)


def write_history(directory: Path, count: int) -> None:
    """`count` retired tombstones, as `drop` leaves them: a state file and the marker."""
    state = json.dumps(
        {"entry_digests": {}, "frozen": True, "incomplete": False, "indexed_size": 0, "retired": True,
         "snapshot_id": "0" * 32, "version": 5},
        sort_keys=True,
    ).encode()
    for i in range(count):
        stem = directory / f"h{i:06d}"
        Path(f"{stem}.tokens.retired").touch()
        Path(f"{stem}.tokens.state.json").write_bytes(state)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Result:
    history: int
    p50_ms: float
    p99_ms: float
    rollouts: int
    rows_per_s: float
    executor: str = ""


def _stream(directory: Path, executor: str):
    import raycap

    return raycap.Stream([directory], watch=True, executor=executor, version_key="policy_version")


def _warm(directory: Path, executor: str) -> None:
    """One untimed step, so workers, actors and imports are up before timing."""
    from raycap import TokenCaptureStore

    store = TokenCaptureStore(directory)
    for i in range(4):
        for entry in _entries(f"w{i}", i):
            store.append(entry)
        store.freeze_raw(f"w{i}", read=False)
    with _stream(directory, executor) as stream:
        rows = stream.take(4, timeout=120)
        stream.commit(rows)


def measure_latency(
    directory: Path, executor: str, writers: int, per_writer: int, rate: float, steps: Path
) -> tuple[list[float], str]:
    """Freeze -> take latencies (ms) of a taker waiting in take(1), and where the stream built."""
    ctx = mp.get_context("spawn")
    finished, frozen = ctx.Queue(), ctx.Queue()
    arrived: dict[str, float] = {}
    taken = []
    lock = threading.Condition()
    with _stream(directory, executor) as stream:
        total = writers * per_writer
        done = threading.Event()

        def commit_steps() -> None:
            step = 0
            while True:
                with lock:
                    while len(taken) < STEP and not (done.is_set() and taken):
                        if done.is_set() and not taken:
                            return
                        lock.wait(0.1)
                    batch = taken[:STEP]
                    del taken[:STEP]
                import pyarrow as pa

                stream.commit(pa.concat_tables(batch), output=steps / f"latency-{step:05d}")
                step += 1

        committer = threading.Thread(target=commit_steps, daemon=True)
        committer.start()
        procs = [ctx.Process(target=_writer, args=(str(directory), f"l{w}-", per_writer, rate, finished)) for w in range(writers)]
        procs.append(ctx.Process(target=_finalizer, args=(str(directory), writers, finished, frozen)))
        for p in procs:
            p.start()
        waited = 0
        while len(arrived) < total:
            # Whether the taker is already waiting when its rollout is frozen: it is when
            # nothing built is pending as it calls take(1) (a read of the stream's queue,
            # for this report only).
            waited += not stream._built
            rows = stream.take(1, timeout=60)
            now = time.time()
            if not rows.num_rows:
                raise RuntimeError(f"no rollout arrived for 60 s ({len(arrived)} of {total} so far)")
            arrived[rows.column("rollout_id")[0].as_py()] = now
            with lock:
                taken.append(rows)
                lock.notify_all()
        done.set()
        with lock:
            lock.notify_all()
        committer.join()
        stamps = {}
        while True:
            item = frozen.get()
            if item is None:
                break
            stamps[item[0]] = item[1]
        for p in procs:
            p.join()
        choice = stream.rebuilder.last_executor
        where = "?" if choice is None else choice.executor
        where += f"; the taker was waiting in take(1) for {waited} of {total}"
    return [(arrived[rid] - stamps[rid]) * 1000 for rid in stamps], where


def measure_throughput(directory: Path, executor: str, count: int, steps: Path) -> float:
    from raycap import TokenCaptureStore

    store = TokenCaptureStore(directory)
    for i in range(count):
        rollout_id = f"t{i:06d}"
        for entry in _entries(rollout_id, i):
            store.append(entry)
    store.freeze_many([f"t{i:06d}" for i in range(count)], read=False)
    with _stream(directory, executor) as stream:
        started = time.monotonic()
        rows_done = 0
        step = 0
        while rows_done < count:
            rows = stream.take(STEP, timeout=60)
            if not rows.num_rows:
                raise RuntimeError("the backlog stopped arriving")
            stream.commit(rows, output=steps / f"throughput-{step:05d}")
            rows_done += rows.num_rows
            step += 1
        return rows_done / (time.monotonic() - started)


NODE_STEP = 16


def _node_writer(directory: str, prefix: str, rate: float, seconds: float, frozen) -> None:
    """One node's writers and finalizer: copy each rollout in under a temporary name,
    rename it into place, freeze it; stamp when the freeze returned."""
    import numpy as np

    from bench.step import rollout_bytes
    from raycap import TokenCaptureStore

    rng = np.random.default_rng(abs(hash(prefix)) & 0xFFFF)
    store = TokenCaptureStore(directory, create=False)
    started = time.monotonic()
    i = 0
    while time.monotonic() - started < seconds:
        rid = f"{prefix}{i:06d}"
        temp = os.path.join(directory, f".in-{rid}.tokens.jsonl")
        with open(temp, "wb") as fh:
            fh.write(rollout_bytes(rid, rng))
        os.rename(temp, os.path.join(directory, f"{rid}.tokens.jsonl"))
        store.freeze_raw(rid, read=False)
        frozen.put((rid, time.time()))
        i += 1
        wait = started + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    frozen.put(None)


def node_latency(specs: list[str], dirs: list[Path], rate: float, seconds: float, steps: Path, tag: str) -> list[float]:
    """Freeze -> take latencies (ms) of a taker in take(1) over node-qualified directories,
    with a committer thread committing every NODE_STEP taken rollouts."""
    import pyarrow as pa

    import raycap

    ctx = mp.get_context("spawn")
    frozen = ctx.Queue()
    arrived: dict[str, float] = {}
    stamps: dict[str, float] = {}
    taken: list = []
    ready = threading.Condition()
    done = threading.Event()
    with raycap.Stream(specs, watch=True, executor="ray") as stream:

        def commit_steps() -> None:
            step = 0
            while True:
                with ready:
                    ready.wait_for(lambda: len(taken) >= NODE_STEP or done.is_set())
                    batch, taken[:] = taken[:NODE_STEP], taken[NODE_STEP:]
                if not batch:
                    return
                stream.commit(pa.concat_tables(batch), output=steps / f"{tag}-{step:05d}")
                step += 1

        committer = threading.Thread(target=commit_steps, daemon=True)
        committer.start()
        writers = [
            ctx.Process(target=_node_writer, args=(str(d), f"{tag}-n{k}-", rate / len(dirs), seconds, frozen), daemon=True)
            for k, d in enumerate(dirs)
        ]
        for p in writers:
            p.start()
        ended = 0
        while ended < len(writers) or len(arrived) < len(stamps):
            while True:  # the stamps so far (the writers' queue is read as it fills)
                try:
                    item = frozen.get_nowait()
                except Exception:  # noqa: BLE001 - queue.Empty
                    break
                if item is None:
                    ended += 1
                else:
                    stamps[item[0]] = item[1]
            if ended == len(writers) and len(arrived) >= len(stamps):
                break
            rows = stream.take(1, timeout=2.0 if ended < len(writers) else 60)
            now = time.time()
            if not rows.num_rows:
                if ended == len(writers):
                    raise RuntimeError(f"no rollout arrived for 60 s ({len(arrived)} of {len(stamps)} so far)")
                continue
            arrived[rows.column("rollout_id")[0].as_py()] = now
            with ready:
                taken.append(rows)
                ready.notify_all()
        done.set()
        with ready:
            ready.notify_all()
        committer.join()
        for p in writers:
            p.join(timeout=30)
    return [(arrived[rid] - stamps[rid]) * 1000 for rid in stamps]


def run_nodes(args: argparse.Namespace) -> dict[tuple[int, float], tuple[float, float, int]]:
    """The latency over node-qualified directories of simulated nodes (see the module docstring)."""
    import logging

    import ray
    from ray.cluster_utils import Cluster

    logging.getLogger("raycap").setLevel(logging.ERROR)
    counts = sorted({int(c) for c in args.nodes.split(",")})
    rates = [float(r) for r in args.rates.split(",")]
    root = Path(tempfile.mkdtemp(prefix="raycap-bench-stream-nodes-", dir=args.tmp))
    store_bytes = 100 << 20
    # A private, short temp dir (Ray's socket paths under it must fit): other clusters on
    # this machine never share its session files.
    ray_tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    os.environ["RAY_TMPDIR"] = ray_tmp
    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": store_bytes,
    })
    results: dict[tuple[int, float], tuple[float, float, int]] = {}
    try:
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        nodes: list[str] = []
        steps = root / "steps"
        steps.mkdir()
        for count in counts:
            while len(nodes) < count:
                nodes.append(cluster.add_node(num_cpus=1, object_store_memory=store_bytes).node_id)
                cluster.wait_for_nodes()
                (root / f"n{len(nodes) - 1}").mkdir()
            dirs = [root / f"n{i}" for i in range(count)]
            specs = [f"{node}:{d}" for node, d in zip(nodes, dirs)]
            node_latency(specs, dirs, 4.0, 3.0, steps, f"w{count}")  # untimed: workers and actors up
            for rate in rates:
                values = node_latency(specs, dirs, rate, args.seconds, steps, f"r{count}-{rate:g}")
                results[(count, rate)] = (_percentile(values, 0.5), _percentile(values, 0.99), len(values))
                print(f"{count} node{'s' * (count > 1)}, {rate:g} rollouts/s: freeze->take p50 "
                      f"{results[(count, rate)][0]:7.1f} ms  p99 {results[(count, rate)][1]:7.1f} ms  "
                      f"max {max(values):7.1f} ms ({len(values)} rollouts)", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print("| nodes | rollouts/s | p50 ms | p99 ms | rollouts |")
    print("|---|---|---|---|---|")
    for (count, rate), (p50, p99, n) in results.items():
        print(f"| {count} | {rate:g} | {p50:.1f} | {p99:.1f} | {n} |")
    ok = all(p50 <= 100 and p99 <= 500 for p50, p99, _ in results.values())
    print(f"targets p50 <= 100 ms, p99 <= 500 ms: {'met' if ok else 'NOT MET'}", flush=True)
    return results


def run(args: argparse.Namespace) -> list[Result]:
    if args.nodes:
        run_nodes(args)
        return []
    if args.executor == "ray":
        import ray

        ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING")
    results = []
    # Rounds alternate which directory goes first, so neither run always follows the
    # other (a Ray that has just done a run is in a different state than one that has not).
    order = [[0, args.history] if i % 2 == 0 else [args.history, 0] for i in range(args.repeat)]
    for history in [h for pair in order for h in pair]:
        root = Path(tempfile.mkdtemp(prefix="raycap-bench-stream-", dir=args.tmp))
        try:
            directory, steps = root / "captures", root / "steps"
            directory.mkdir()
            steps.mkdir()
            started = time.monotonic()
            write_history(directory, history)
            if history:
                print(f"wrote {history} retired tombstones in {time.monotonic() - started:.1f} s", flush=True)
            _warm(directory, args.executor)
            # Flush what the setup (and the previous run's cleanup, 40,000 unlinks after a
            # history run) left dirty, so commits' fsyncs do not pay for it in this run.
            os.sync()
            time.sleep(1.0)
            latencies, where = measure_latency(
                directory, args.executor, args.writers, args.rollouts // args.writers, args.rate, steps
            )
            rate = measure_throughput(directory, args.executor, args.backlog, steps)
            result = Result(history, _percentile(latencies, 0.5), _percentile(latencies, 0.99), len(latencies), rate, where)
            print(
                f"history {history:>6}: freeze->take p50 {result.p50_ms:7.1f} ms  p99 {result.p99_ms:7.1f} ms "
                f"({result.rollouts} rollouts, mean {statistics.fmean(latencies):.1f} ms, built on {where})  "
                f"throughput {result.rows_per_s:7.1f} rows/s ({args.backlog} rollouts, steps of {STEP})",
                flush=True,
            )
            results.append(result)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    report(results, args.history)
    return results


def report(results: list[Result], history: int) -> dict[str, float]:
    """The medians over repeats, history / fresh, and whether the targets hold."""
    def median(at: int, name: str) -> float:
        return statistics.median(getattr(r, name) for r in results if r.history == at)

    fresh = {name: median(0, name) for name in ("p50_ms", "p99_ms", "rows_per_s")}
    old = {name: median(history, name) for name in ("p50_ms", "p99_ms", "rows_per_s")}
    growth = {
        "p50": old["p50_ms"] / fresh["p50_ms"],
        "p99": old["p99_ms"] / fresh["p99_ms"],
        "rows/s": fresh["rows_per_s"] / old["rows_per_s"],  # > 1 when history slows it
    }
    repeats = sum(1 for r in results if r.history == 0)
    for label, values in (("fresh", fresh), (f"{history} retired", old)):
        print(f"median of {repeats}, {label:>14}: freeze->take p50 {values['p50_ms']:7.1f} ms  "
              f"p99 {values['p99_ms']:7.1f} ms  throughput {values['rows_per_s']:7.1f} rows/s")
    ok = max(fresh["p50_ms"], old["p50_ms"]) <= 100 and max(fresh["p99_ms"], old["p99_ms"]) <= 500
    ok = ok and max(growth.values()) <= 1.3
    print(
        f"growth with {history} retired rollouts (history / fresh): p50 x{growth['p50']:.2f}, "
        f"p99 x{growth['p99']:.2f}, rows/s x{growth['rows/s']:.2f} "
        f"(targets: p50 <= 100 ms, p99 <= 500 ms, growth <= 1.3x): {'met' if ok else 'NOT MET'}",
        flush=True,
    )
    return growth


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--executor", default="ray", choices=("ray", "local", "auto"))
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the embedded Ray")
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=200, help="rollouts of the latency run, over all writers")
    parser.add_argument("--rate", type=float, default=10.0, help="rollouts per second per writer")
    parser.add_argument("--backlog", type=int, default=640, help="rollouts of the throughput run")
    parser.add_argument("--history", type=int, default=20_000, help="retired rollouts in the second run")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of both runs; medians are reported")
    parser.add_argument("--tmp", default=None, help="where the directories go (default: the system temp)")
    parser.add_argument("--nodes", default="", help="node counts of the node-qualified latency run, e.g. 1,3")
    parser.add_argument("--rates", default="4,20", help="rollouts per second over all nodes (with --nodes)")
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each configuration (with --nodes)")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
