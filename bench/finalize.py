"""Benchmark of finalizing a rollout collection's results file (`raycap.finalize_rollouts`).

Run: `python -m bench.finalize` (options: `--help`; `make bench` runs the small default).
It writes a synthetic collection, then finalizes the same records two ways, each in a
fresh process and on its own copy of the captures (freezing writes state):

- `finalize_rollouts`: the whole results file at once, on each executor asked for
  (`--executors`, default ray and local), without retirement;
- the Gym-style loop: the project's own single-rollout path, one record at a time, as
  a rollout collection finalizes: parse the line, `await
  raycap.delivery.finalize_rollout_token_capture(record, TokenCaptureStore(dir))`,
  write the record (orjson) and flush; fsync the file at the end.

Reported per executor: records/s of each, their ratio (finalize_rollouts / loop), and
the finalizing driver's peak RSS (VmHWM of the driver process alone: Ray's workers and
the object store are other processes), with the results file's size beside it, so a
flat peak over a growing file shows that the driver does not hold the records. Ray's
start-up (an embedded Ray here) is not counted; everything from the call to its return
is. `--loop-records` times the loop on the first records only (its rate is per record,
and a 100,000-record loop takes many minutes).

The collection: `--records` rollouts of `--calls` chained calls each (prompt, 16
generated tokens per call, tool tokens between), written straight into a capture
directory in the store's format; and a results file with one record per rollout (task
and rollout indices, reward, agent, a served response) padded to about `--record-bytes`
with the conversation a real record carries.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.proc import _env, _python, _run

GENERATED = 16
TOOL = 12
PROMPT = 48

_FINALIZE = """
import json, sys, time
import raycap
from raycap.cluster.connect import connect
captures, results, output, executor, cpus = sys.argv[1:6]
if executor == "ray":
    connect(None, num_cpus=int(cpus))
start = time.perf_counter()
outcome = raycap.finalize_rollouts([captures], results, output, executor=executor)
seconds = time.perf_counter() - start
counts = outcome.summary.records
print(json.dumps({"seconds": seconds, "records": counts.records, "finalized": counts.finalized,
                  "masked": counts.masked, "executor": outcome.summary.executor.name}), flush=True)
"""

_LOOP = """
import asyncio, json, os, sys, time, warnings
import orjson
from raycap.delivery import finalize_rollout_token_capture
from raycap.store import TokenCaptureStore
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


def write_collection(work: Path, records: int, record_bytes: int, calls: int) -> tuple[Path, Path]:
    """A capture directory and its results file (see the module docstring)."""
    import random

    import orjson

    from raycap.records import TokenEntry, entry_line, line_digest

    captures = work / "captures"
    captures.mkdir(parents=True)
    results = work / "results.jsonl"
    rng = random.Random(7)
    words = "the model reads the file then calls the tool and checks the answer".split()
    # The conversation a record carries: slices of one long text, at random offsets.
    corpus = " ".join(rng.choice(words) for _ in range(max(record_bytes, 1024) // 2))
    with open(results, "wb") as out:
        for index in range(records):
            task, rollout = divmod(index, 8)
            rollout_id = f"{task}-{rollout}"
            prompt = [rng.randrange(50_000) for _ in range(PROMPT)]
            lines = []
            for call in range(calls):
                generation = [rng.randrange(50_000) for _ in range(GENERATED)]
                lines.append(entry_line(TokenEntry(
                    rollout_id=rollout_id, model_call_id=f"call-{call}", model="policy", prompt_token_ids=prompt,
                    generation_token_ids=generation, generation_log_probs=[-0.25] * GENERATED,
                    output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
                    token_item_index=0, created_at=float(call),
                )))
                prompt = prompt + generation + [rng.randrange(50_000) for _ in range(TOOL)]
            data = b"".join(line + b"\n" for line in lines)
            (captures / f"{rollout_id}.tokens.jsonl").write_bytes(data)
            # The state a writer leaves (its index of the lines), as `TokenCaptureStore.append` would.
            state = {"frozen": False, "retired": False, "incomplete": False, "snapshot_id": "", "version": calls,
                     "entry_digests": {f"call-{call}": line_digest(line) for call, line in enumerate(lines)},
                     "indexed_size": len(data)}
            (captures / f"{rollout_id}.tokens.state.json").write_bytes(json.dumps(state, sort_keys=True).encode())
            record = {
                "_ng_task_index": task, "_ng_rollout_index": rollout, "reward": rng.random(),
                "agent_ref": {"name": "bench_agent"},
                "responses_create_params": {"input": []},
                "response": {"id": f"resp-{index}", "model": "policy", "object": "response",
                             "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]},
            }
            base = len(orjson.dumps(record))
            filler = max(0, record_bytes - base - 40)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.finalize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2000, help="records (rollouts) in the results file (default %(default)s)")
    parser.add_argument("--record-bytes", type=int, default=4096, help="about how large each record is (default %(default)s)")
    parser.add_argument("--calls", type=int, default=3, help="model calls per rollout (default %(default)s)")
    parser.add_argument("--executors", default="ray,local", help="finalize_rollouts executors to time (default %(default)s)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs of the embedded Ray (default: all)")
    parser.add_argument("--loop-records", type=int, default=0, help="time the Gym-style loop on the first N records only (0: all)")
    parser.add_argument("--work", help="directory for the collection (default: a temporary one, removed after)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="raycap-bench-finalize-"))
    try:
        started = time.perf_counter()
        captures, results = write_collection(work / "collection", args.records, args.record_bytes, args.calls)
        size = results.stat().st_size
        print(f"collection: {args.records:,} records, {size / 1e6:,.1f} MB of results, written in {time.perf_counter() - started:.1f} s", file=sys.stderr)

        loop_dir = _copy(captures, work / "loop-captures")
        loop = _run(_python(_LOOP, str(loop_dir), str(results), str(work / "loop.jsonl"), str(args.loop_records)), _env(), what="the Gym-style loop")
        looped = json.loads(loop.lines[-1])
        loop_rate = looped["records"] / looped["seconds"]
        shutil.rmtree(loop_dir)
        report: dict = {
            "records": args.records, "results_bytes": size,
            "loop": {"records": looped["records"], "seconds": round(looped["seconds"], 2), "records_per_s": round(loop_rate, 1)},
            "finalize": {},
        }
        for executor in [e.strip() for e in args.executors.split(",") if e.strip()]:
            directory = _copy(captures, work / f"{executor}-captures")
            output = work / f"{executor}-out"
            run = _run(
                _python(_FINALIZE, str(directory), str(results), str(output), executor, str(args.cpus)), _env(),
                what=f"finalize_rollouts ({executor})",
            )
            done = json.loads(run.lines[-1])
            rate = done["records"] / done["seconds"]
            report["finalize"][executor] = {
                "seconds": round(done["seconds"], 2), "records_per_s": round(rate, 1), "ratio": round(rate / loop_rate, 2),
                "driver_peak_rss_mb": round(run.max_rss / 1e6, 1), "masked": done["masked"], "ran": done["executor"],
            }
            shutil.rmtree(directory)
            shutil.rmtree(output)
        if args.json:
            print(json.dumps(report))
        else:
            print(f"results file            {args.records:,} records, {size / 1e6:,.1f} MB")
            print(f"Gym-style loop          {report['loop']['records_per_s']:,.1f} records/s ({report['loop']['records']:,} records)")
            for executor, row in report["finalize"].items():
                print(
                    f"finalize_rollouts {executor:<6}{row['records_per_s']:>8,.1f} records/s  {row['ratio']:.2f}x the loop  "
                    f"driver peak RSS {row['driver_peak_rss_mb']:,.0f} MB  ({row['seconds']:.1f} s)"
                )
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
