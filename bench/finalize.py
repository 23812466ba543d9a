"""Benchmark of finalizing a rollout collection's results file (`raycap.finalize_rollouts`).

Run: `python -m bench.finalize` (options: `--help`; `make bench` runs the small default).
It writes a synthetic collection (`--profile`: `default`, many small rollouts of 3
calls with 4 KB records; `long`, long agentic rollouts: 128 records of about 500 bytes
over 120 rollouts of 40 calls, prompts growing from 1,800 to some 14,000 tokens, about
230 MB of captures), then finalizes the same records several ways, each in a fresh
process and on its own copy of the captures (freezing writes state):

- the Gym-style loop, the baseline: the project's own single-rollout path, one record
  at a time, as a rollout collection finalizes: parse the line, `await
  raycap.capture.delivery.finalize_rollout_token_capture(record, TokenCaptureStore(dir))`,
  write the record (orjson) and flush; fsync the file at the end;
- `ray`: Ray started in the process (embedded, `--cpus`), then `finalize_rollouts`
  timed from the call to its return (`--ray-calls` calls, each on its own copy: the
  first pays for starting Ray's workers);
- `fresh`: `import raycap; raycap.finalize_rollouts(...)` in a new process, timed from
  spawn to exit, against the loop's process from spawn to exit;
- `local`: the local executor, timed in the process.

With `--records-file`, each `finalize_rollouts` call also writes the finalized records
as one results file beside its output (`records_file=`), as the loop writes its file;
`--records-file both` times every contender both ways in the same rounds (`+records`
rows), so a records file's cost is read off side by side.

`--repeat N` runs N rounds, each running every contender once, interleaved, and
reports medians; each ratio is the median of the rounds' ratios (loop time over
contender time), so a noisy, shared machine moves both sides of each ratio alike.
`--base DIR` times another checkout (today's code, say) the same way in the same
rounds, for before/after numbers side by side. The driver's peak RSS (VmHWM of the
driver process alone: Ray's workers and the object store are other processes) is
reported beside the results file's size; for `fresh` and `local`, so is the CPU time of
the process and the worker processes it waited for (user + sys), which a shared
machine's load moves less than wall time. `--loop-records` times the loop on the first
records only (its rate is per record, and a 100,000-record loop takes many minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.proc import REPO, _env, _python, _run

GENERATED = 16
TOOL = 12
PROMPT = 48

# Ray started in the process (embedded, `--cpus`), then each capture copy finalized in turn:
# the first call pays for starting Ray's workers, a later one finds them up.
_RAY = """
import json, os, sys, time
import raycap
from raycap.cluster.plumbing.connect import connect
results, cpus = sys.argv[1], int(sys.argv[2])
records_file = os.environ.get("BENCH_RECORDS_FILE")
connect(None, num_cpus=cpus)
for captures, output in zip(sys.argv[3::2], sys.argv[4::2]):
    start = time.perf_counter()
    outcome = raycap.finalize_rollouts([captures], results, output, executor="ray",
                                       records_file=output + ".jsonl" if records_file else None)
    seconds = time.perf_counter() - start
    counts = outcome.summary.records
    print(json.dumps({"seconds": seconds, "records": counts.records, "finalized": counts.finalized,
                      "masked": counts.masked, "executor": outcome.summary.executor.name, "raycap": raycap.__file__}), flush=True)
"""

# A user's script: nothing but the import and the call; timed from spawn to exit.
_FRESH = """
import os, sys
import raycap
records_file = sys.argv[3] + ".jsonl" if os.environ.get("BENCH_RECORDS_FILE") else None
outcome = raycap.finalize_rollouts([sys.argv[1]], sys.argv[2], sys.argv[3], records_file=records_file)
print(outcome.summary.executor.name, outcome.summary.records.records, flush=True)
"""

# The local executor, timed in the process (imports left out).
_LOCAL = """
import json, os, sys, time
import raycap
records_file = sys.argv[3] + ".jsonl" if os.environ.get("BENCH_RECORDS_FILE") else None
start = time.perf_counter()
outcome = raycap.finalize_rollouts([sys.argv[1]], sys.argv[2], sys.argv[3], executor="local", records_file=records_file)
counts = outcome.summary.records
print(json.dumps({"seconds": time.perf_counter() - start, "records": counts.records, "masked": counts.masked}), flush=True)
"""

_LOOP = """
import asyncio, json, os, sys, time, warnings
import orjson
from raycap.capture.delivery import finalize_rollout_token_capture
from raycap.capture.store import TokenCaptureStore
captures, results, out, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
warnings.simplefilter("ignore")

async def collect():
    store = TokenCaptureStore(captures)
    done = 0
    with open(results, "rb") as source, open(out, "wb") as target:
        for line in source:
            if not line.strip():
                continue
            if limit and done >= limit:
                break
            record = orjson.loads(line)
            await finalize_rollout_token_capture(record, store)
            target.write(orjson.dumps(record) + b"\\n")
            target.flush()
            done += 1
        os.fsync(target.fileno())
    return done

start = time.perf_counter()
done = asyncio.run(collect())
print(json.dumps({"seconds": time.perf_counter() - start, "records": done}), flush=True)
"""


@dataclass(frozen=True)
class Profile:
    """A synthetic collection's shape: `records` records over `rollouts` captured
    rollouts (records past them name rollouts with no capture), `calls` chained calls
    each, the first prompt `prompt` tokens long, each call generating `generated` tokens
    and each tool result adding `tool`, and records padded to about `record_bytes`."""

    records: int
    rollouts: int
    calls: int
    record_bytes: int
    prompt: int = PROMPT
    generated: int = GENERATED
    tool: int = TOOL


# Today's benchmark, and long agentic rollouts: dozens of calls, prompts growing to
# thousands of tokens (about 230 MB of captures), small records.
PROFILES = {
    "default": Profile(records=2000, rollouts=2000, calls=3, record_bytes=4096),
    "long": Profile(records=128, rollouts=120, calls=40, record_bytes=500, prompt=1800, generated=128, tool=192),
}


def write_collection(work: Path, profile: Profile) -> tuple[Path, Path]:
    """A capture directory and its results file (see the module docstring)."""
    import random

    import orjson

    from raycap.capture.records import TokenEntry, entry_line, line_digest

    captures = work / "captures"
    captures.mkdir(parents=True)
    results = work / "results.jsonl"
    rng = random.Random(7)
    words = "the model reads the file then calls the tool and checks the answer".split()
    # The conversation a record carries: slices of one long text, at random offsets.
    corpus = " ".join(rng.choice(words) for _ in range(max(profile.record_bytes, 1024) // 2))
    items = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]
    with open(results, "wb") as out:
        for index in range(profile.records):
            task, rollout = divmod(index, 8)
            rollout_id = f"{task}-{rollout}"
            if index < profile.rollouts:
                prompt = [rng.randrange(50_000) for _ in range(profile.prompt)]
                lines = []
                for call in range(profile.calls):
                    generation = [rng.randrange(50_000) for _ in range(profile.generated)]
                    lines.append(entry_line(TokenEntry(
                        rollout_id=rollout_id, model_call_id=f"call-{call}", model="policy", prompt_token_ids=prompt,
                        generation_token_ids=generation, generation_log_probs=[-0.25] * profile.generated,
                        output_items=items, token_item_index=0, created_at=float(call),
                    )))
                    prompt = prompt + generation + [rng.randrange(50_000) for _ in range(profile.tool)]
                data = b"".join(line + b"\n" for line in lines)
                (captures / f"{rollout_id}.tokens.jsonl").write_bytes(data)
                # The state and lock file a writer leaves (its index of the lines), as `TokenCaptureStore.append` would.
                state = {"frozen": False, "retired": False, "incomplete": False, "snapshot_id": "", "version": profile.calls,
                         "entry_digests": {f"call-{call}": line_digest(line) for call, line in enumerate(lines)},
                         "indexed_size": len(data)}
                (captures / f"{rollout_id}.tokens.state.json").write_bytes(json.dumps(state, sort_keys=True).encode())
                (captures / f"{rollout_id}.tokens.lock").touch()  # the lock file every append takes
            record = {
                "_ng_task_index": task, "_ng_rollout_index": rollout, "reward": rng.random(),
                "agent_ref": {"name": "bench_agent"},
                "responses_create_params": {"input": []},
                "response": {"id": f"resp-{index}", "model": "policy", "object": "response", "output": items},
            }
            base = len(orjson.dumps(record))
            filler = max(0, profile.record_bytes - base - 40)
            if filler:
                at = rng.randrange(max(1, len(corpus) - filler))
                text = (corpus * (1 + filler // len(corpus)))[at : at + filler]
                record["responses_create_params"]["input"] = [{"role": "user", "content": text}]
            out.write(orjson.dumps(record) + b"\n")
    return captures, results


def _copy(captures: Path, target: Path) -> Path:
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(captures, target)
    os.sync()
    return target


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Bench:
    """The runs of one benchmark: each in a fresh process on its own copy of the captures."""

    def __init__(self, work: Path, captures: Path, results: Path, cpus: int, trees: dict[str, str]):
        self.work, self.captures, self.results, self.cpus, self.trees = work, captures, results, cpus, trees
        self.runs = 0

    def _copies(self, n: int) -> list[tuple[str, str]]:
        out = []
        for _ in range(n):
            self.runs += 1
            directory = _copy(self.captures, self.work / f"captures-{self.runs}")
            output = self.work / f"out-{self.runs}"
            out.append((str(directory), str(output)))
        return out

    def _clean(self, pairs: list[tuple[str, str]]) -> None:
        for directory, output in pairs:
            shutil.rmtree(directory, ignore_errors=True)
            shutil.rmtree(output, ignore_errors=True)
            Path(output).unlink(missing_ok=True)  # the loop's output is a file
            Path(f"{output}.summary.json").unlink(missing_ok=True)  # the summary written beside the output
            Path(f"{output}.jsonl").unlink(missing_ok=True)  # --records-file

    def _env(self, tree: str, records_file: bool = False) -> dict[str, str]:
        path = self.trees[tree]
        extra = {"BENCH_RECORDS_FILE": "1"} if records_file else {}
        return _env(PYTHONPATH=path or str(REPO), **extra)

    def _cwd(self, tree: str) -> Path:
        """Where a child starts: its tree, which `python -c` puts first on its path."""
        return Path(self.trees[tree] or REPO)

    def loop(self, limit: int) -> dict:
        ((directory, output),) = self._copies(1)
        try:
            run = _run(_python(_LOOP, directory, str(self.results), output, str(limit)), self._env("this"), cwd=REPO, what="the Gym-style loop")
        finally:
            self._clean([(directory, output)])
        done = json.loads(run.lines[-1])
        return {"seconds": done["seconds"], "process": run.exited, "records": done["records"]}

    def ray(self, tree: str, records_file: bool, calls: int) -> dict:
        for attempt in range(5):
            pairs = self._copies(calls)
            try:
                argv = _python(_RAY, str(self.results), str(self.cpus), *[v for pair in pairs for v in pair])
                run = _run(argv, self._env(tree, records_file), cwd=self._cwd(tree), what=f"finalize_rollouts on Ray ({tree})")
                break
            except RuntimeError as exc:
                # A busy machine can keep an embedded Ray from starting in time: start again.
                if "timed out during startup" not in str(exc) or attempt == 4:
                    raise
            finally:
                self._clean(pairs)
        done = [json.loads(line) for line in run.lines if line.startswith("{")]
        return {"seconds": [d["seconds"] for d in done], "records": done[0]["records"], "masked": done[0]["masked"], "raycap": done[0].get("raycap"),
                "ran": done[0]["executor"], "driver_peak_rss_mb": run.max_rss / 1e6}

    def fresh(self, tree: str, records_file: bool) -> dict:
        ((directory, output),) = self._copies(1)
        try:
            run = _run(_python(_FRESH, directory, str(self.results), output), self._env(tree, records_file), cwd=self._cwd(tree), what=f"finalize_rollouts end to end ({tree})")
        finally:
            self._clean([(directory, output)])
        ran, records = run.lines[-1].split()
        return {"process": run.exited, "cpu": run.cpu, "ran": ran, "records": int(records), "driver_peak_rss_mb": run.max_rss / 1e6}

    def local(self, tree: str, records_file: bool) -> dict:
        ((directory, output),) = self._copies(1)
        try:
            run = _run(_python(_LOCAL, directory, str(self.results), output), self._env(tree, records_file), cwd=self._cwd(tree), what=f"finalize_rollouts, local ({tree})")
        finally:
            self._clean([(directory, output)])
        done = json.loads(run.lines[-1])
        return {"seconds": done["seconds"], "cpu": run.cpu, "records": done["records"], "driver_peak_rss_mb": run.max_rss / 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.finalize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default", help="the collection's shape (default %(default)s)")
    parser.add_argument("--records", type=int, help="records in the results file (default: the profile's)")
    parser.add_argument("--rollouts", type=int, help="captured rollouts; records past them have none (default: the profile's)")
    parser.add_argument("--record-bytes", type=int, help="about how large each record is (default: the profile's)")
    parser.add_argument("--calls", type=int, help="model calls per rollout (default: the profile's)")
    parser.add_argument("--modes", default="ray,fresh,local", help="finalize_rollouts runs to time: ray, fresh, local (default %(default)s)")
    parser.add_argument("--executors", help="the same as --modes (kept for older command lines)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds, each running every contender once, interleaved (default %(default)s)")
    parser.add_argument("--ray-calls", type=int, default=1, help="finalize_rollouts calls timed after Ray starts, each on its own copy (default %(default)s)")
    parser.add_argument("--base", help="also time this source tree (a checkout of another commit) the same way, interleaved")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs of the embedded Ray (default: all)")
    parser.add_argument("--records-file", nargs="?", const="on", default="off", choices=("on", "both"),
                        help="each finalize_rollouts call also writes the finalized records as one results file (records_file=), "
                             "as the loop does; 'both': every contender with and without it, in the same rounds")
    parser.add_argument("--loop-records", type=int, default=0, help="time the Gym-style loop on the first N records only (0: all)")
    parser.add_argument("--work", help="directory for the collection (default: a temporary one, removed after)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    records = args.records if args.records is not None else profile.records
    profile = replace(
        profile, records=records,
        rollouts=args.rollouts if args.rollouts is not None else (profile.rollouts if args.records is None else records),
        calls=args.calls or profile.calls, record_bytes=args.record_bytes or profile.record_bytes,
    )
    modes = [m.strip() for m in (args.executors or args.modes).split(",") if m.strip()]
    unknown = sorted(set(modes) - {"ray", "fresh", "local"})
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from ray, fresh, local")
    trees = {"this": ""}
    if args.base:
        trees = {"base": str(Path(args.base).resolve()), "this": ""}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="raycap-bench-finalize-"))
    try:
        started = time.perf_counter()
        if args.work and (work / "collection" / "results.jsonl").exists():
            captures, results = work / "collection" / "captures", work / "collection" / "results.jsonl"  # written before
        else:
            captures, results = write_collection(work / "collection", profile)
        size = results.stat().st_size
        capture_bytes = sum(f.stat().st_size for f in captures.iterdir())
        print(
            f"collection: {profile.records:,} records ({size / 1e6:,.2f} MB), {capture_bytes / 1e6:,.1f} MB of captures, "
            f"written in {time.perf_counter() - started:.1f} s", file=sys.stderr,
        )
        bench = Bench(work, captures, results, args.cpus, trees)
        ways = {"off": [False], "on": [True], "both": [False, True]}[args.records_file]
        # (name, mode, with a records file): "+records" names the second way of "both".
        contenders = [(f"{mode}{'+records' if way and len(ways) > 1 else ''}", mode, way) for mode in modes for way in ways]
        rounds: list[dict] = []
        for round_no in range(args.repeat):
            one: dict = {"loop": bench.loop(args.loop_records)}
            for name, mode, way in contenders:
                for tree in trees:
                    one[f"{name}/{tree}"] = bench.ray(tree, way, args.ray_calls) if mode == "ray" else getattr(bench, mode)(tree, way)
            rounds.append(one)
            print(f"round {round_no + 1}: " + json.dumps(one), file=sys.stderr)
        report = _report(rounds, profile, size, capture_bytes, [name for name, _, _ in contenders], trees, args.ray_calls)
        if args.json:
            print(json.dumps(report))
        else:
            _print(report)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _report(rounds: list[dict], profile: Profile, size: int, capture_bytes: int, modes: list[str], trees: dict, calls: int) -> dict:
    """Medians over the rounds; each ratio is the median of the rounds' ratios (loop time
    / contender time, the loop per record when it ran on the first records only)."""
    loops = [r["loop"] for r in rounds]
    per_record = [loop["seconds"] / loop["records"] for loop in loops]
    report: dict = {
        "profile": asdict(profile), "results_bytes": size, "capture_bytes": capture_bytes, "rounds": len(rounds),
        "loop": {"records": loops[0]["records"], "seconds": round(_median([x["seconds"] for x in loops]), 2),
                 "process_seconds": round(_median([x["process"] for x in loops]), 2),
                 "records_per_s": round(1 / _median(per_record), 1)},
        "finalize": {},
    }
    records = profile.records
    for mode in modes:
        for tree in trees:
            runs = [r[f"{mode}/{tree}"] for r in rounds]
            row: dict = {"ran": runs[0]["ran"] if "ran" in runs[0] else "local",
                         "driver_peak_rss_mb": round(_median([x["driver_peak_rss_mb"] for x in runs]), 1)}
            if mode.startswith("ray"):
                for call in range(calls):
                    seconds = [x["seconds"][call] for x in runs]
                    ratios = [p * records / s for p, s in zip(per_record, seconds)]
                    row[f"call {call + 1}"] = {"seconds": round(_median(seconds), 2), "ratio": round(_median(ratios), 2)}
            elif mode.startswith("fresh"):
                # Process against process: the loop's whole process, scaled to every record.
                seconds = [x["process"] for x in runs]
                loop_process = [lp["process"] - lp["seconds"] + p * records for lp, p in zip(loops, per_record)]
                row["process"] = {"seconds": round(_median(seconds), 2), "ratio": round(_median([a / b for a, b in zip(loop_process, seconds)]), 2)}
            else:
                seconds = [x["seconds"] for x in runs]
                row["call"] = {"seconds": round(_median(seconds), 2), "ratio": round(_median([p * records / s for p, s in zip(per_record, seconds)]), 2)}
            if all("cpu" in x for x in runs):
                # The process's CPU, its worker processes' included: steadier than wall
                # time on a shared machine, and what a change of the work itself moves.
                row["cpu_seconds"] = round(_median([x["cpu"] for x in runs]), 2)
            report["finalize"][f"{mode}/{tree}"] = row
    return report


def _print(report: dict) -> None:
    profile = report["profile"]
    loop = report["loop"]
    print(
        f"collection              {profile['records']:,} records ({report['results_bytes'] / 1e6:,.2f} MB), "
        f"{report['capture_bytes'] / 1e6:,.1f} MB of captures, {profile['calls']} calls per rollout; medians of {report['rounds']} rounds"
    )
    print(
        f"Gym-style loop          {loop['records_per_s']:,.1f} records/s ({loop['records']:,} records: {loop['seconds']:.2f} s "
        f"in the process, {loop['process_seconds']:.2f} s from spawn to exit)"
    )
    names = {"ray": "Ray started", "fresh": "fresh process", "local": "executor local"}
    for key, row in report["finalize"].items():
        mode, tree = key.split("/")
        kind, _, way = mode.partition("+")
        label = f"{names[kind]}{' + ' + way if way else ''} ({tree})"
        timings = [(name, t) for name, t in row.items() if isinstance(t, dict)]
        text = "  ".join(f"{name}: {t['seconds']:.2f} s, {t['ratio']:.2f}x the loop" for name, t in timings)
        cpu = f", process CPU {row['cpu_seconds']:.2f} s, workers included" if "cpu_seconds" in row else ""
        print(f"{label:<24}{text}  [ran {row['ran']}{cpu}, driver peak RSS {row['driver_peak_rss_mb']:,.0f} MB]")


if __name__ == "__main__":
    sys.exit(main())
