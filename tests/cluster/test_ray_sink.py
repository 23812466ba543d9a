"""The Ray-served TokenSink (`raycap.token_sink`): the store's guarantees through a node actor.

The quick tests run on the shared embedded Ray and read the capture files directly to
see what is durable when a call returns. The slow one adds a worker node to the session's
simulated cluster (see conftest), serves the directory from the worker node only, and has
Ray tasks on both nodes write different calls of the same rollouts at once, then checks
everything against a freeze.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import ray

import raycap
from raycap.capture.records import TokenEntry, entry_line
from raycap.capture.store import TokenCaptureStore
from raycap.cluster.rebuild.session import token_source


def _entry(rollout_id: str, call: int, *, generated: int = 2) -> TokenEntry:
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=f"c{call}",
        prompt_token_ids=[1, 2, 3 + call],
        generation_token_ids=[10 + call] * generated,
        generation_log_probs=[-0.5] * generated,
    )


def _state(directory: Path, rollout_id: str) -> dict:
    return json.loads((directory / f"{rollout_id}.tokens.state.json").read_text())


def _lines(directory: Path, rollout_id: str) -> list[bytes]:
    return [line for line in (directory / f"{rollout_id}.tokens.jsonl").read_bytes().splitlines() if line.strip()]


def _store_error(directory: Path, action) -> BaseException:
    """What the local store raises for the same action, for comparison."""
    with pytest.raises(Exception) as caught:
        action(TokenCaptureStore(directory))
    return caught.value


def test_the_sink_is_a_token_sink_that_pickles_and_writes_durably_before_put_returns(ray_shared, tmp_path):
    sink = raycap.token_sink(str(tmp_path))
    assert isinstance(sink, raycap.TokenSink)
    entry = _entry("r1", 0)
    asyncio.run(sink.put(entry))
    # Read from the disk, not through the actor: the line is there when put returns.
    assert _lines(tmp_path, "r1") == [entry_line(entry)]
    again = pickle.loads(pickle.dumps(sink))
    asyncio.run(again.put(_entry("r1", 1)))
    assert len(_lines(tmp_path, "r1")) == 2
    asyncio.run(sink.close())
    asyncio.run(sink.put(_entry("r1", 2)))  # close releases nothing a later call needs
    assert len(_lines(tmp_path, "r1")) == 3


def test_a_repeated_put_is_a_no_op_and_a_different_payload_fails_with_the_stores_error(ray_shared, tmp_path):
    sink = raycap.token_sink(str(tmp_path))
    first = _entry("r1", 0)
    asyncio.run(sink.put(first))
    version = _state(tmp_path, "r1")["version"]
    asyncio.run(sink.put(first))
    assert _lines(tmp_path, "r1") == [entry_line(first)]
    assert _state(tmp_path, "r1")["version"] == version

    other = _entry("r1", 0, generated=3)
    with pytest.raises(ValueError) as caught:
        asyncio.run(sink.put(other))
    assert type(caught.value) is ValueError  # the store's own exception, not Ray's wrapper
    assert "reused with a different payload" in str(caught.value)
    assert _state(tmp_path, "r1")["incomplete"] is True
    # The text is exactly what the local store says for the same reuse.
    local = tmp_path / "local"
    TokenCaptureStore(local).append(first)
    assert str(caught.value) == str(_store_error(local, lambda store: store.append(other)))


def test_a_put_or_begin_call_after_freeze_is_refused_like_the_store_refuses_it(ray_shared, tmp_path):
    sink = raycap.token_sink(str(tmp_path))
    asyncio.run(sink.put(_entry("r1", 0)))
    source = token_source(str(tmp_path))
    snapshot = asyncio.run(source.freeze("r1"))
    with pytest.raises(RuntimeError, match="already frozen") as caught:
        asyncio.run(sink.put(_entry("r1", 1)))
    assert type(caught.value) is RuntimeError
    with pytest.raises(RuntimeError, match="already frozen"):
        asyncio.run(sink.begin_call("r1", "c9"))
    assert _lines(tmp_path, "r1") == [entry_line(_entry("r1", 0))]
    assert asyncio.run(source.freeze("r1")) == snapshot


def test_mark_incomplete_and_begin_call_are_durable_and_make_the_snapshot_incomplete(ray_shared, tmp_path):
    sink = raycap.token_sink(str(tmp_path))
    asyncio.run(sink.put(_entry("marked", 0)))
    asyncio.run(sink.mark_incomplete("marked", "c1"))
    assert _state(tmp_path, "marked")["incomplete"] is True
    assert (tmp_path / "marked.tokens.incomplete").read_text() == "c1\n"

    asyncio.run(sink.begin_call("lost", "c0"))
    assert (tmp_path / "lost.tokens.intents").read_text() == "c0\n"
    asyncio.run(sink.begin_call("landed", "c0"))
    asyncio.run(sink.put(_entry("landed", 0)))

    store = TokenCaptureStore(tmp_path)
    freeze = getattr(store, "freeze_now", store.freeze)
    assert freeze("marked").incomplete
    assert freeze("lost").incomplete
    assert not freeze("landed").incomplete


def test_a_record_of_another_token_entry_class_is_accepted_and_an_invalid_one_fails_in_the_caller(ray_shared, tmp_path):
    from pydantic import BaseModel, ConfigDict, ValidationError

    class OtherEntry(BaseModel):  # NeMo Gym's TokenEntry has these fields
        model_config = ConfigDict(extra="allow")
        rollout_id: str
        model_call_id: str
        prompt_token_ids: list[int]
        generation_token_ids: list[int]
        generation_log_probs: list[float]

    sink = raycap.token_sink(str(tmp_path))
    mine = _entry("r1", 0)
    asyncio.run(sink.put(OtherEntry(**mine.model_dump(include=set(OtherEntry.model_fields)))))
    assert _lines(tmp_path, "r1") == [entry_line(mine)]
    with pytest.raises(ValidationError, match="same length"):
        asyncio.run(sink.put({**mine.model_dump(), "model_call_id": "c1", "generation_log_probs": [-1.0]}))
    assert len(_lines(tmp_path, "r1")) == 1


def test_a_sink_installed_as_the_process_default_is_the_one_writers_get(ray_shared, tmp_path):
    from raycap.capture import protocols

    install = getattr(protocols, "install_token_sink", None)
    if install is None:
        pytest.skip("raycap.capture.protocols has no install_token_sink")
    sink = raycap.token_sink(str(tmp_path))
    previous = protocols.installed_token_sink()
    install(sink)
    try:
        installed = protocols.installed_token_sink()
        assert installed is sink
        asyncio.run(installed.put(_entry("r1", 0)))
        assert len(_lines(tmp_path, "r1")) == 1
    finally:
        install(previous)


def test_a_directory_that_does_not_exist_cannot_get_a_sink(ray_shared, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        raycap.token_sink(str(tmp_path / "missing"))


# --- two nodes ---------------------------------------------------------------------------

ROLLOUTS = ("ra", "rb", "rc")
CALLS = 12
WRITERS = 4


@pytest.fixture
def two_nodes(ray_cluster):
    """(head node id, worker node id, the root the worker sees absolute paths under): the
    session cluster's head and a worker node added for this test, this process a fresh
    driver; the node is removed after the test."""
    from raycap.cluster.plumbing.placement import ROOT_LABEL

    root = tempfile.mkdtemp(prefix="raycap-sink-node-")
    try:
        with ray_cluster.nodes([{"raycap-node": "sink-worker", ROOT_LABEL: root}]):
            ray_cluster.connect(fresh=True)
            node_of = ray_cluster.node_ids()
            yield node_of["head"], node_of["sink-worker"], Path(root)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def _writer():
    """A Ray task writing calls through a sink, each twice (a retried put is a no-op).
    Made in a function, so Ray ships it by value: workers cannot import this module."""

    @ray.remote(num_cpus=0)
    def write(sink, calls: list[tuple[str, int]]) -> str:
        from raycap.capture.records import TokenEntry

        def entry(rollout_id: str, call: int) -> TokenEntry:
            return TokenEntry(
                rollout_id=rollout_id,
                model_call_id=f"c{call}",
                prompt_token_ids=[1, 2, 3 + call],
                generation_token_ids=[10 + call] * 2,
                generation_log_probs=[-0.5] * 2,
            )

        async def run() -> None:
            for rollout_id, call in calls:
                await sink.put(entry(rollout_id, call))
            await asyncio.gather(*(sink.put(entry(rollout_id, call)) for rollout_id, call in calls))

        asyncio.run(run())
        return ray.get_runtime_context().get_node_id()

    return write


@pytest.mark.slow
def test_concurrent_writers_on_two_nodes_lose_nothing_and_duplicate_nothing(two_nodes):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head, worker, root = two_nodes
    # The directory exists only where the worker node sees it, so its actor serves it
    # there, and the writers on the head reach it across nodes.
    path = "/captures/run-1"
    (root / "captures" / "run-1").mkdir(parents=True)
    sink = raycap.token_sink(path)
    calls = [(rollout_id, call) for call in range(CALLS) for rollout_id in ROLLOUTS]
    shares = [calls[k::WRITERS] for k in range(WRITERS)]  # every writer touches every rollout
    placed = [head, worker] * (WRITERS // 2)
    write = _writer()
    writers = [
        write.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(sink, share)
        for node, share in zip(placed, shares)
    ]
    assert ray.get(writers) == placed
    assert not Path(path).exists()  # nothing was written on the head's view of the path

    source = token_source(path)
    on_disk = root / "captures" / "run-1"
    for rollout_id in ROLLOUTS:
        snapshot = asyncio.run(source.freeze(rollout_id))
        ids = [entry.model_call_id for entry in snapshot.entries]
        assert sorted(ids) == sorted(f"c{call}" for call in range(CALLS))  # each exactly once
        assert {entry.model_call_id: entry for entry in snapshot.entries} == {
            f"c{call}": _entry(rollout_id, call) for call in range(CALLS)
        }
        assert not snapshot.incomplete
        assert snapshot.version == CALLS + 1  # one per distinct record, one for the freeze
        assert len(_lines(on_disk, rollout_id)) == CALLS
        with pytest.raises(RuntimeError, match="already frozen"):
            ray.get(write.remote(sink, [(rollout_id, CALLS)]))
        assert asyncio.run(source.freeze(rollout_id)) == snapshot


# --- model servers outside Ray, configured as NeMo Gym configures them -----------------------------

# A model server process: builds its sink from the run's config exactly as NeMo Gym does
# (TokenIdCaptureConfig(...).build_sink()), waits until the other server is up, then serves
# its requests concurrently under capture contexts. Prints what it committed.
MODEL_SERVER = r"""
import asyncio, json, sys, time
from pathlib import Path

import ray

from raycap.capture.config import TokenIdCaptureConfig
from raycap.capture.records import TokenEntry
from raycap.capture.sink import CaptureContext, capture_tokens, commit_entry, register_call_intent, reset_token_sink, set_token_sink

address, capture_dir, writer, sync = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
config = TokenIdCaptureConfig(token_id_capture={
    "enabled": True,
    "sink": "raycap.cluster.sink:RayTokenSink",
    "sink_kwargs": {"capture_dir": capture_dir, "address": address},
})
sink = config.build_sink()
(sync / f"ready-{writer}").touch()
deadline = time.monotonic() + 120
while not all((sync / f"ready-{w}").exists() for w in (0, 1)):
    assert time.monotonic() < deadline, "the other model server never came up"
    time.sleep(0.01)


def turns(n):
    prompt = [1, 2, 3]
    for k in range(n):
        generation = [10 + k, 20 + k]
        yield f"c{k}", list(prompt), generation
        prompt += generation + [5]


async def request(rollout_id, call_id, *, response=None, entry=None):
    context = CaptureContext(rollout_id=rollout_id, model_call_id=call_id, token_sink=sink, model="policy")
    token = set_token_sink(context)
    try:
        await register_call_intent()
        await (capture_tokens(response) if entry is None else commit_entry(entry))
    finally:
        reset_token_sink(token)
    return [rollout_id, call_id, context.committed, None if entry is None else entry.model_dump()]


def served(prompt, generation):
    return {"model": "served", "output": [{"type": "message", "role": "assistant", "content": "ok",
            "prompt_token_ids": prompt, "generation_token_ids": generation,
            "generation_log_probs": [-0.5] * len(generation)}]}


def entry(rollout_id, call_id, prompt, generation):
    return TokenEntry(rollout_id=rollout_id, model_call_id=call_id, model="policy", prompt_token_ids=prompt,
                      generation_token_ids=generation, generation_log_probs=[-0.5] * len(generation), created_at=1.0)


async def serve():
    requests = []
    for rollout_id in ("shared-0", "shared-1", "shared-2"):  # both servers, the same payloads, each twice
        for call_id, prompt, generation in turns(6):
            requests += [request(rollout_id, call_id, entry=entry(rollout_id, call_id, prompt, generation))] * 2
    for call_id, prompt, generation in turns(4):  # this server's own rollout, from served responses
        requests.append(request(f"own-{writer}", call_id, response=served(prompt, generation)))
    # Both servers write call c0 of one rollout with different payloads: one must lose.
    requests.append(request("conflict", "c0", entry=entry("conflict", "c0", [1, 2, 3], [100 + writer])))
    return await asyncio.gather(*requests)


results = asyncio.run(serve())
pid = ray.get(sink.handle.actor.pid.remote())
print(json.dumps({"results": results, "actor_pid": pid, "sink": type(sink).__name__}))
"""


@pytest.mark.slow
def test_model_servers_outside_ray_write_through_one_shared_node_actor_by_configuration(two_nodes, ray_cluster, tmp_path):
    import importlib
    import os
    import subprocess
    import sys
    import uuid

    from raycap.capture.consumer import trajectories_from_source
    from raycap.cluster.nodes.actor import running_actor

    head, worker, root = two_nodes
    path = f"/captures/gym-{uuid.uuid4().hex[:8]}"
    on_disk = root / path.lstrip("/")
    on_disk.mkdir(parents=True)
    assert running_actor(worker) is None  # the servers start the worker node's actor
    script = tmp_path / "model_server.py"
    script.write_text(MODEL_SERVER)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), RAY_USAGE_STATS_ENABLED="0")
    # One server names the directory by its node, the other by its path alone.
    specs = [f"raycap-node=sink-worker:{path}", path]
    servers = [
        subprocess.Popen([sys.executable, str(script), ray_cluster.address, spec, str(writer), str(tmp_path)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for writer, spec in enumerate(specs)
    ]
    reports = []
    for server in servers:
        out, err = server.communicate(timeout=240)
        assert server.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))

    # One detached actor on the worker node served both servers, and outlived them.
    assert {report["sink"] for report in reports} == {"RayTokenSink"}
    actor = running_actor(worker)
    assert actor is not None and ray.get(actor.node_id.remote()) == worker
    assert reports[0]["actor_pid"] == reports[1]["actor_pid"] == ray.get(actor.pid.remote())
    assert not Path(path).exists()  # nothing was written on the head's view of the path

    results = [result for report in reports for result in report["results"]]
    assert all(committed for rollout_id, _, committed, _ in results if rollout_id != "conflict")
    # Same call id and payload: a no-op, so every call is on disk once.
    for rollout_id in ("shared-0", "shared-1", "shared-2", "own-0", "own-1"):
        assert len(_lines(on_disk, rollout_id)) == (6 if rollout_id.startswith("shared") else 4)
    # Every acknowledged put is durable, exactly as it was acknowledged.
    lines = {rid: set(_lines(on_disk, rid)) for rid in ("shared-0", "shared-1", "shared-2", "conflict")}
    for rollout_id, _, committed, payload in results:
        if committed and payload is not None:
            assert entry_line(TokenEntry.model_validate(payload)) in lines[rollout_id]
    # A different payload under a used call id: exactly one server's put was acknowledged,
    # the other's raised, and the rollout is marked incomplete.
    conflict = [(committed, payload) for rollout_id, _, committed, payload in results if rollout_id == "conflict"]
    assert sorted(committed for committed, _ in conflict) == [False, True]
    winner = next(payload for committed, payload in conflict if committed)
    assert _lines(on_disk, "conflict") == [entry_line(TokenEntry.model_validate(winner))]
    assert _state(on_disk, "conflict")["incomplete"] is True

    # A consumer names the matching source the same way ("module:Class" and keyword
    # arguments), and the rollouts build.
    module, _, name = "raycap:RayTokenSource".partition(":")
    source = getattr(importlib.import_module(module), name)(capture_dir=specs[1], address=ray_cluster.address)
    assert isinstance(source, raycap.TokenSource)
    for rollout_id, calls in (("shared-0", 6), ("shared-2", 6), ("own-0", 4), ("own-1", 4)):
        built = asyncio.run(trajectories_from_source(rollout_id, source))
        assert built["mask_sample"] is False, built
        assert built["metrics"]["n_calls"] == calls and built["metrics"]["generated_tokens_delivered"] == 2 * calls
    masked = asyncio.run(trajectories_from_source("conflict", source))
    assert masked["mask_sample"] is True and masked["metrics"]["capture_incomplete"] is True
