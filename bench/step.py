"""Benchmark of a training step: 64 just-finished rollouts rebuilt from a directory with history.

A trainer calls rebuild on every step with the ids of the rollouts that just finished,
while the capture directories keep everything not yet retired (and masked rollouts for
good). So a step's cost must follow its ids, not the directory's history.

Two directories hold small two-call rollouts ("history", ids h000000...), e.g. 500 and
20,000, written once as plain JSONL (what a writer without an index leaves) and kept.
Each step then writes, per directory and contender, 64 new rollouts never frozen before,
times one step of each contender on its own ids, checks the rows, and removes the step's
rollouts again, so a directory holds its history (plus the step) whenever it is timed:

  raycap N      one `raycap.Rebuilder([dir], executor="ray")` per directory, kept across
                steps (the trainer's pattern), on the Ray already running
  reference N   the straightforward sequential consumer, per rollout:
                `reference_trajectories_for_rollout(rid, [dir])` for each id
  local N       raycap's in-process executor, for comparison (no target)
  base N        with `base` (another checkout, `python -m bench --base DIR`): that
                tree's kept Rebuilder, timed the same way in the same rounds

With `base`, both trees' Rebuilders run in processes of their own (`StepServer`: the
tree's code, its own embedded Ray of the same CPUs, timed inside that process exactly as
here), so neither tree runs where the other does not; without it, `raycap N` runs in
this process, on the Ray already running. Contenders are interleaved step by step, in an
order that rotates, after one untimed warm-up step; medians and spreads are reported.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

HISTORY_PREFIX = "h"
STEP_PREFIX = "s"
PROMPT_TOKENS = 120
GENERATION_TOKENS = 32
TOOL_TOKENS = 24
VOCAB = 151_936
_SUFFIXES = (".tokens.jsonl", ".tokens.state.json", ".tokens.lock", ".tokens.intents", ".tokens.incomplete", ".tokens.retired")


def _record(rollout_id: str, call: int, prompt: list[int], generation: np.ndarray, rng: np.random.Generator) -> bytes:
    log_probs = np.round(-rng.random(len(generation)) * 2.0, 4).tolist()
    item = {
        "type": "message",
        "id": f"msg-{rollout_id}-{call}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "done" if call == 2 else "let me look", "annotations": []}],
    }
    record = {
        "created_at": 1_750_000_000.0 + call,
        "generation_log_probs": log_probs,
        "generation_token_ids": generation.tolist(),
        "model": "bench",
        "model_call_id": f"{rollout_id}-call-{call}",
        "output_items": [item],
        "prompt_token_ids": prompt,
        "rollout_id": rollout_id,
        "routed_experts": None,
        "schema_version": 1,
        "token_item_index": 0,
    }
    return orjson.dumps(record, option=orjson.OPT_SORT_KEYS) + b"\n"


def rollout_bytes(rollout_id: str, rng: np.random.Generator) -> bytes:
    """The JSONL of one small two-call rollout: the second prompt extends the first call."""
    first_prompt = rng.integers(0, VOCAB, PROMPT_TOKENS)
    first_gen = rng.integers(0, VOCAB, GENERATION_TOKENS)
    tool = rng.integers(0, VOCAB, TOOL_TOKENS)
    second_prompt = np.concatenate([first_prompt, first_gen, tool]).tolist()
    return _record(rollout_id, 1, first_prompt.tolist(), first_gen, rng) + _record(
        rollout_id, 2, second_prompt, rng.integers(0, VOCAB, GENERATION_TOKENS), rng
    )


def write_rollouts(directory: Path, ids: list[str], rng: np.random.Generator) -> None:
    for rid in ids:
        with open(directory / f"{rid}.tokens.jsonl", "wb") as fh:
            fh.write(rollout_bytes(rid, rng))


def remove_rollouts(directory: Path, ids: list[str]) -> None:
    for rid in ids:
        for suffix in _SUFFIXES:
            try:
                os.unlink(directory / f"{rid}{suffix}")
            except FileNotFoundError:
                pass


def history_dir(work: Path, rollouts: int, seed: int) -> Path:
    """A directory of `rollouts` small two-call rollouts, written once and cached; any
    step rollouts an interrupted run left behind are removed."""
    directory = work / f"step-history-{rollouts}"
    if not directory.exists():
        print(f"writing {rollouts} small rollouts into {directory} ...", flush=True)
        partial = work / f".step-history-{rollouts}.partial"
        partial.mkdir(parents=True, exist_ok=True)
        write_rollouts(partial, [f"{HISTORY_PREFIX}{i:06d}" for i in range(rollouts)], np.random.default_rng(seed))
        partial.rename(directory)
    with os.scandir(directory) as entries:
        stale = [e.name for e in entries if e.name.startswith(STEP_PREFIX)]
    for name in stale:
        os.unlink(directory / name)
    return directory



def reference_oracle():
    """The test oracle, tests/reference.py: the plainly written builders and consumer of
    the spec, and the baseline every ratio of the benchmark is measured against. It is
    not part of the package, so it is loaded from the repository."""
    import importlib.util
    import sys

    name = "raycap_reference_oracle"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "tests" / "reference.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]

@dataclass
class StepResult:
    ids_per_step: int
    steps: int
    times: dict[str, list[float]] = field(default_factory=dict)  # contender -> seconds per step
    problems: list[str] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def spread(self, name: str) -> tuple[float, float, float]:
        """(min, p90, max) of a contender's steps, in seconds (p90: nearest rank)."""
        ordered = sorted(self.times[name])
        return ordered[0], ordered[max(0, -(-9 * len(ordered) // 10) - 1)], ordered[-1]


_REPLY = "step-reply "


class StepServer:
    """A kept `raycap.Rebuilder` per directory in a process of its own, running one
    tree's code (a checkout's `raycap`) on an embedded Ray of its own: `step(dir, ids)`
    times one step there as `run_steps` times one here (the call alone, then `settle`
    untimed) and returns (seconds, the rows' ids, how many are masked)."""

    def __init__(self, tree: str, dirs: list[Path], cpus: int) -> None:
        self.tree = tree
        self.temp = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths must fit
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=tree, RAY_TMPDIR=self.temp)
        env.pop("RAY_ADDRESS", None)
        self.process = subprocess.Popen(
            # This file runs the loop (a base checkout's own may have none), over the tree's raycap.
            [sys.executable, __file__, "--serve", str(cpus), *map(str, dirs)], cwd=tree, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._reply()  # Ray started, the Rebuilders made

    def _reply(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(_REPLY):
                return json.loads(line[len(_REPLY):])
        raise RuntimeError(f"the step server exited ({self.process.wait()}); see its output above")

    def step(self, directory: Path, ids: list[str]) -> tuple[float, list[str], int]:
        self.process.stdin.write(json.dumps({"dir": str(directory), "ids": ids}) + "\n")
        self.process.stdin.flush()
        got = self._reply()
        return got["seconds"], got["rows"], got["masked"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)
        import shutil

        shutil.rmtree(self.temp, ignore_errors=True)


def _serve(cpus: int, dirs: list[str]) -> None:
    """The loop of a StepServer's process."""
    import logging

    import raycap
    from raycap.cluster.rebuild.session import connect

    if not raycap.__file__.startswith(os.getcwd()):
        sys.exit(f"the step server imported raycap from {raycap.__file__}, not from {os.getcwd()}")
    logging.disable(logging.WARNING)
    connect(num_cpus=cpus)
    rebuilders = {d: raycap.Rebuilder([d], executor="ray") for d in dirs}
    print(_REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        asked = json.loads(line)
        rebuilder = rebuilders[asked["dir"]]
        start = time.perf_counter()
        table = rebuilder.rebuild(asked["ids"])
        seconds = time.perf_counter() - start
        rebuilder.settle()
        rows = table.column("rollout_id").to_pylist()
        masked = sum(table.column("mask_sample").to_pylist())
        print(_REPLY + json.dumps({"seconds": seconds, "rows": rows, "masked": masked}), flush=True)
    for rebuilder in rebuilders.values():
        rebuilder.close()


def run_steps(
    dirs: dict[int, Path], *, steps: int, ids_per_step: int, seed: int, base: str | None = None, cpus: int = 2
) -> StepResult:
    """Time `steps` steps of every contender on every directory (Ray must be running in
    this process, unless `base` names another checkout: see the module docstring)."""
    import raycap
    reference_trajectories_for_rollout = reference_oracle().reference_trajectories_for_rollout

    rng = np.random.default_rng(seed + 1)
    tag = np.base_repr(time.time_ns() // 1_000_000, 36).lower()
    servers = {}
    if base is not None:
        servers = {tree: StepServer(str(Path(path).resolve()), list(dirs.values()), cpus)
                   for tree, path in (("raycap", Path(__file__).resolve().parents[1]), ("base", base))}
    contenders = []
    for n, d in dirs.items():
        local = raycap.Rebuilder([str(d)], executor="local")
        if servers:
            for tree, server in servers.items():
                contenders.append((f"{tree} {n}", d, "served", lambda ids, d=d, s=server: s.step(d, ids), None))
        else:
            on_ray = raycap.Rebuilder([str(d)], executor="ray")
            contenders.append((f"raycap {n}", d, "table", on_ray.rebuild, on_ray.settle))
        contenders.append((
            f"reference {n}", d, "builds", lambda ids, d=d: [reference_trajectories_for_rollout(rid, [d]) for rid in ids],
            None,
        ))
        contenders.append((f"local {n}", d, "table", local.rebuild, local.settle))
    result = StepResult(ids_per_step, steps, {name: [] for name, *_ in contenders})
    try:
        _interleave(result, contenders, dirs, steps, ids_per_step, rng, tag)
    finally:
        for server in servers.values():
            server.close()
    return result


def _interleave(result: StepResult, contenders: list, dirs: dict[int, Path], steps: int, ids_per_step: int, rng, tag: str) -> None:

    for step in range(-1, steps):  # step -1 warms up: placement, actors, worker imports
        order = contenders[step % len(contenders):] + contenders[: step % len(contenders)]
        batches = {}
        for c, (name, d, *_) in enumerate(contenders):
            ids = [f"{STEP_PREFIX}{tag}-{step + 1}-{c}-{k}" for k in range(ids_per_step)]
            write_rollouts(d, ids, rng)
            batches[name] = ids
        os.sync()  # the step's files are on disk before anything is timed, as a writer's would be
        try:
            for name, _, kind, call, settle in order:
                ids = batches[name]
                start = time.perf_counter()
                out = call(ids)
                seconds = time.perf_counter() - start
                if kind == "served":
                    seconds, *out = out  # timed in its own process, the same way
                if settle is not None:
                    settle()  # what the call left to do in the background (spare files) is not timed with the next
                if step >= 0:
                    result.times[name].append(seconds)
                _check(result, name, kind, out, ids)
        finally:
            for name, d, *_ in contenders:
                remove_rollouts(d, batches[name])


def _check(result: StepResult, name: str, kind: str, out, ids: list[str]) -> None:
    if kind == "table":
        got = out.column("rollout_id").to_pylist()
        masked = sum(out.column("mask_sample").to_pylist())
    elif kind == "served":
        got, masked = out
    else:
        got = [b["rollout_id"] for b in out]
        masked = sum(bool(b["mask_sample"]) for b in out)
    if got != ids or masked:
        result.problems.append(f"{name}: {len(got)} rows for {len(ids)} ids, {masked} masked")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        sys.exit("usage: python bench/step.py --serve CPUS DIR... (run by StepServer; see `python -m bench --help`)")
    _serve(int(sys.argv[2]), sys.argv[3:])
