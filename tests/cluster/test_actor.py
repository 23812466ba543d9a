"""The Ray delivery layer on one embedded Ray: rows, order, directories, retirement,
the actor as a TokenSource, placement errors and the actor's concurrency."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import re
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import ray

import raycap
from conftest import on_ray, write_entries
from raycap.capture.outcomes import FreezeFailed
from raycap.capture.store import TokenCaptureStore
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.cluster.nodes import fleet as fleet_module
from raycap.cluster.nodes.actor import ACTOR_NAMESPACE, IO_THREADS, CaptureNode, actor_name, running_actor
from raycap.cluster.plumbing.placement import CaptureDir
from raycap.cluster.rebuild import session as cluster
from raycap.rows.arrow import ROLLOUT_SCHEMA

NO_RECORDS = "capture contains no token records"
SMALL = dict(system_tokens=(20, 60), turns=(4, 5), generation_tokens=(1, 20), tool_tokens=(1, 20))


def _local(ids, directory):
    return [raycap.trajectories_for_rollout(rid, [directory]) for rid in ids]


def _clean_rollout(directory: Path, rollout_id: str, seed: int):
    """The entries of one well-formed multi-turn rollout (written to a scratch directory)."""
    scratch = directory / f"scratch-{rollout_id}"
    generate_corpus(scratch, CorpusSpec(rollouts=1, seed=seed, fault_share=0.0, id_prefix=rollout_id, **SMALL))
    (written,) = TokenCaptureStore(scratch).rollout_ids()
    entries = TokenCaptureStore(scratch).freeze_now(written).entries
    shutil.rmtree(scratch)
    return written, list(entries)


def _committed(table: pa.Table, output: Path) -> Path:
    """`table` as a committed output: retirement reads only committed rows."""
    from raycap.output.commit import Inputs, StagedOutput
    from raycap.output.shards import write_shard

    delivery = "chains" if "chain_id" in table.schema.names else "rollout"
    inputs = Inputs(("test",), None, "prefix_merging", "", delivery)
    with StagedOutput(output, inputs=inputs, schema=delivery) as staged:
        staged.commit([write_shard(staged.staging, 0, table)])
    return output


def test_rows_equal_the_local_consumer_on_every_fault_shape(ray_shared, fault_corpus, corpus_copy, comparable):
    local_dir, ray_dir = corpus_copy("local"), corpus_copy("ray")
    ids = list(fault_corpus.rollout_ids) + ["missing-1"]  # retired ones too, by id
    random.Random(7).shuffle(ids)

    table = on_ray([ray_dir], ids, batch_size=3)

    assert table.schema == ROLLOUT_SCHEMA
    assert table.column("rollout_id").to_pylist() == ids  # the order asked for
    rows = raycap.builds_from_table(table)
    for rid, row, expected in zip(ids, rows, _local(ids, local_dir)):
        assert comparable(row, ray_dir) == comparable(expected, local_dir), (rid, fault_corpus.shapes.get(rid))
    # The shapes really were exercised: failed freezes, failed builds, masks, successes.
    errors = {row["error"].split(":")[0] for row in rows if row.get("error")}
    assert {"ValidationError", "JSONDecodeError", "RuntimeError", "ValueError"} <= errors
    assert any(not row["mask_sample"] for row in rows)
    assert any(row["mask_sample"] and not row.get("error") for row in rows)
    # Each row carries the snapshot its freeze made: freezing again returns it.
    store = TokenCaptureStore(ray_dir)
    for rid, snapshot_id, version in zip(
        ids, table.column("snapshot_id").to_pylist(), table.column("snapshot_version").to_pylist()
    ):
        if snapshot_id is not None:
            again = store.freeze_raw(rid)
            assert (again.snapshot_id, again.version) == (snapshot_id, version)


def test_an_explicit_id_nobody_holds_is_a_masked_row(ray_shared, corpus_copy):
    directory = corpus_copy("d")
    (row,) = raycap.builds_from_table(on_ray([directory], ["missing-1"]))
    assert row["rollout_id"] == "missing-1"
    assert row["mask_sample"] is True and row["error"] == NO_RECORDS
    assert row["rebuilt_response"] is None


def test_listing_unions_directories_in_sorted_order(ray_shared, tmp_path):
    first = tmp_path / "first"
    second = tmp_path / "second"
    generate_corpus(first, CorpusSpec(rollouts=3, seed=1, fault_share=0.0, id_prefix="b", **SMALL))
    generate_corpus(second, CorpusSpec(rollouts=3, seed=2, fault_share=0.0, id_prefix="a", **SMALL))

    table = on_ray([str(first), str(second)], batch_size=2)

    assert table.column("rollout_id").to_pylist() == ["a0000", "a0001", "a0002", "b0000", "b0001", "b0002"]
    assert table.column("capture_dirs").to_pylist() == [[str(second)]] * 3 + [[str(first)]] * 3
    assert not any(table.column("mask_sample").to_pylist())
    assert on_ray([str(first), str(second)], []).num_rows == 0


def test_a_rollout_split_over_two_directories_is_built_from_both(ray_shared, tmp_path, comparable):
    rid, entries = _clean_rollout(tmp_path, "split", seed=11)
    whole = write_entries(tmp_path / "whole", entries)
    part_a = write_entries(tmp_path / "a", entries[0::2])
    part_b = write_entries(tmp_path / "b", entries[1::2])

    table = on_ray([part_a, part_b])

    (row,) = raycap.builds_from_table(table)
    expected = raycap.trajectories_for_rollout(rid, [whole])
    assert row["mask_sample"] is False
    assert comparable(row, "")[0] == comparable(expected, "")[0]
    (snapshots,) = table.column("snapshots").to_pylist()
    assert [s["capture_dir"] for s in snapshots] == [part_a, part_b]
    assert table.column("capture_dirs").to_pylist() == [[part_a, part_b]]

    report = raycap.retire([part_a, part_b], _committed(table, tmp_path / "out"))
    assert (report.dropped, report.changed, report.errors) == (2, [], [])
    for part in (part_a, part_b):
        paths = TokenCaptureStore(part).paths(rid)
        assert not paths.jsonl.exists() and json.loads(paths.state.read_text())["retired"] is True


def test_an_incomplete_part_makes_the_whole_rollout_incomplete(ray_shared, tmp_path):
    rid, entries = _clean_rollout(tmp_path, "split", seed=12)
    part_a = write_entries(tmp_path / "a", entries[:1])
    part_b = write_entries(tmp_path / "b", entries[1:])
    TokenCaptureStore(part_a).mark_incomplete_now(rid, "lost-call")

    table = on_ray([part_a, part_b])

    (row,) = raycap.builds_from_table(table)
    assert row["mask_sample"] is True and row["metrics"]["capture_incomplete"] is True
    assert raycap.retire([part_a, part_b], _committed(table, tmp_path / "out")).dropped == 0  # masked: evidence kept
    assert TokenCaptureStore(part_a).rollout_ids() == [rid] == TokenCaptureStore(part_b).rollout_ids()


def test_retire_drops_only_successful_unmasked_rows_and_is_repeatable(ray_shared, corpus_copy, tmp_path):
    directory = corpus_copy("d")
    table = on_ray([directory], batch_size=7)
    output = Path(tmp_path / "out")
    from raycap.output.commit import Inputs, StagedOutput
    from raycap.output.shards import write_shard

    # Several shards: retirement goes shard by shard.
    with StagedOutput(output, inputs=Inputs(("test",), None, "prefix_merging", ""), schema="rollout") as staged:
        staged.commit([write_shard(staged.staging, i, table.slice(i * 10, 10)) for i in range(-(-table.num_rows // 10))])
    rows = table.select(["rollout_id", "mask_sample", "error"]).to_pylist()
    good = {r["rollout_id"] for r in rows if not r["mask_sample"] and r["error"] is None}
    assert good and len(good) < len(rows)

    store = TokenCaptureStore(directory)
    had = {rid for rid in store.rollout_ids() if store.paths(rid).jsonl.exists()}

    report = raycap.retire([directory], output)

    assert (report.dropped, report.changed, report.errors) == (len(good), [], [])
    left = [rid for rid in store.rollout_ids() if store.paths(rid).jsonl.exists()]
    assert set(left) == had - good  # masked and failed rollouts keep their captures
    again = raycap.retire([directory], output)  # a retried retire changes nothing
    assert again.changed == [] and again.errors == []
    assert [rid for rid in store.rollout_ids() if store.paths(rid).jsonl.exists()] == left
    # The masked rollouts are rebuilt exactly as before, snapshots included; the retired
    # ones are listed as tombstones and say so.
    rebuilt = on_ray([directory], left)
    assert rebuilt.equals(table.filter(pc.is_in(table.column("rollout_id"), value_set=pa.array(left))))
    tombstones = raycap.builds_from_table(on_ray([directory], sorted(good)))
    assert all(b["error"].startswith("RuntimeError") and "retired" in b["error"] for b in tombstones)


def test_retire_reports_a_directory_it_was_not_given(ray_shared, tmp_path):
    rid, entries = _clean_rollout(tmp_path, "split", seed=13)
    part_a = write_entries(tmp_path / "a", entries[0::2])
    part_b = write_entries(tmp_path / "b", entries[1::2])
    table = on_ray([part_a, part_b])

    report = raycap.retire([part_a], _committed(table, tmp_path / "out"))

    assert report.dropped == 1
    assert len(report.errors) == 1 and part_b in report.errors[0]


def test_the_directory_actor_is_a_token_source(ray_shared, fault_corpus, corpus_copy, comparable):
    local_dir, ray_dir = corpus_copy("local"), corpus_copy("ray")
    source = cluster.token_source(ray_dir)
    assert isinstance(source, raycap.TokenSource)
    ids = list(fault_corpus.rollout_ids) + ["missing-1"]

    async def build_all():
        return [await raycap.trajectories_from_source(rid, source) for rid in ids]

    for rid, got, expected in zip(ids, asyncio.run(build_all()), _local(ids, local_dir)):
        # Same error types and texts as a local freeze: Ray's wrappers are removed.
        assert comparable(got, ray_dir) == comparable(expected, local_dir), (rid, fault_corpus.shapes.get(rid))

    async def lifecycle():
        rid = next(r for r, s in fault_corpus.shapes.items() if s == "routed_experts")
        first = await source.freeze(rid)
        second = await source.freeze(rid)
        assert (first.snapshot_id, first.version) == (second.snapshot_id, second.version)
        assert await source.drop(rid, snapshot_id=first.snapshot_id, version=first.version + 1) is False
        assert await source.drop(rid, snapshot_id=first.snapshot_id, version=first.version) is True
        await source.drop(rid, snapshot_id=first.snapshot_id, version=first.version)  # harmless
        with pytest.raises(RuntimeError, match="retired"):
            await source.freeze(rid)
        await source.close()
        assert (await source.freeze("missing-2")).entries == ()  # still serving after close

    asyncio.run(lifecycle())


def test_one_actor_per_node_serves_all_its_directories(ray_shared, corpus_copy):
    directory, other = corpus_copy("d"), corpus_copy("e")
    first = cluster.fleet([directory])
    again = cluster.fleet([directory, other])
    assert first.handles[0].actor._actor_id == again.handles[0].actor._actor_id == again.handles[1].actor._actor_id
    assert [h.path for h in again.handles] == [directory, other]
    here = ray.get_runtime_context().get_node_id()
    assert ray.get(first.handles[0].actor.node_id.remote()) == here
    assert {"name": actor_name(here), "namespace": ACTOR_NAMESPACE} in ray.util.list_named_actors(all_namespaces=True)
    listed = ray.get([h.rollout_ids() for h in again.handles])
    assert listed[0] == listed[1] and listed[0]  # two copies of one corpus, each its own directory


def test_the_node_actor_outlives_a_rebuild_and_serves_the_next_one(ray_shared, corpus_copy):
    first, second = corpus_copy("first"), corpus_copy("second")
    on_ray([first])
    gc.collect()  # the rebuild's own handles are gone
    actor = running_actor(ray.get_runtime_context().get_node_id())
    pid = ray.get(actor.pid.remote())
    table = on_ray([second])
    assert table.num_rows > 0
    assert ray.get(actor.pid.remote()) == pid  # not started again


def test_a_missing_directory_fails_fast_and_starts_no_actor(fresh_ray, tmp_path):
    fresh_ray()  # a new driver: its first call, which would warm up its node's actor
    missing = str(tmp_path / "nowhere")

    def named():
        return sorted((a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True))

    # Node actors are shared and outlive their starters: stop this node's, so that the
    # call would have to start it.
    here = ray.get_runtime_context().get_node_id()
    if (actor := running_actor(here)) is not None:
        ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while running_actor(here) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    before = named()
    assert (ACTOR_NAMESPACE, actor_name(here)) not in before
    started = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(missing)):
        on_ray([missing])
    assert time.monotonic() - started < 20
    assert named() == before


def test_directory_specs_that_cannot_be_placed_are_refused(ray_shared, tmp_path):
    directory = str(tmp_path)
    here = ray.get_runtime_context().get_node_id()
    with pytest.raises(ValueError, match="matches no alive Ray node"):
        cluster.fleet([f"raycap-node=nowhere:{directory}"])
    with pytest.raises(ValueError, match="not an absolute path"):
        cluster.fleet(["node-a:relative/dir"])
    with pytest.raises(ValueError, match="listed twice"):
        cluster.fleet([directory, directory])
    with pytest.raises(ValueError, match="same directory"):
        cluster.fleet([directory, f"{here}:{directory}"])
    with pytest.raises(ValueError, match="does not exist on node"):
        cluster.fleet([f"{here}:{directory}/absent"])


def test_a_directory_handle_travels_as_its_actors_name_never_as_an_actor_handle():
    import pickle

    from raycap.cluster.nodes.actor import DirectoryHandle

    class NotToBeSent:
        def __reduce__(self):
            raise AssertionError("an actor handle was pickled")

    handle = DirectoryHandle(NotToBeSent(), "/caps", actor_name("n1"))
    back = pickle.loads(pickle.dumps(handle))
    assert (back.path, back.name, back.actor.name) == ("/caps", actor_name("n1"), actor_name("n1"))
    assert pickle.loads(pickle.dumps(back)) == back  # looked up only when first called


def test_directory_specs_parse_node_and_path():
    assert CaptureDir.parse("/a/b/") == CaptureDir("/a/b")
    assert CaptureDir.parse("/a:/b") == CaptureDir("/a:/b")  # a plain path with ":/" in it
    assert CaptureDir.parse("rack=a3:/data/caps") == CaptureDir("/data/caps", "rack=a3")
    assert CaptureDir.parse({"node": "10.0.0.5", "path": "/d"}).label == "10.0.0.5:/d"
    with pytest.raises(ValueError, match="expected keys"):
        CaptureDir.parse({"dir": "/d"})
    with pytest.raises(ValueError, match="empty node part"):
        CaptureDir.parse(" :/d")


def test_an_actor_that_cannot_start_is_a_clear_error(ray_shared, tmp_path, monkeypatch):
    # The directory vanished between placement and the actor's start.
    gone = str(tmp_path / "gone")
    here = ray.get_runtime_context().get_node_id()
    monkeypatch.setattr(fleet_module, "locate", lambda dirs: [(CaptureDir(gone), here)])
    with pytest.raises(RuntimeError, match=re.escape(gone) + ".*does not exist"):
        cluster.fleet([gone])
    # the node's actor is unharmed and serves the node's other directories
    assert ray.get(running_actor(here).node_id.remote()) == here


def _frozen_or_error(frozen) -> str:
    if isinstance(frozen, FreezeFailed):
        return frozen.error.split(":", 1)[0]
    return f"{frozen.rollout_id}@{frozen.version}"


def _freeze_here(directory: str, rollout_id: str) -> str:
    try:
        return _frozen_or_error(TokenCaptureStore(directory).freeze_raw(rollout_id))
    except Exception as exc:  # noqa: BLE001 - compared by type
        return type(exc).__name__


def test_actor_file_work_runs_on_its_thread_pool_and_holds_no_cpu(ray_shared, fault_corpus, corpus_copy):
    directory = corpus_copy("d")
    delay = 1.5  # long enough to tell 8-way parallel from serial on a loaded machine

    class SlowNode(CaptureNode):
        """Every freeze blocks for `delay` seconds, like a slow disk."""

        def store(self, path):
            store = super().store(path)
            if not hasattr(store, "slowed"):
                freeze_raw = store.freeze_raw

                def slow(rollout_id, **kwargs):
                    time.sleep(delay)
                    return freeze_raw(rollout_id, **kwargs)

                store.freeze_raw, store.slowed = slow, True
            return store

    actor = ray.remote(SlowNode).options(num_cpus=0).remote()
    try:
        ray.get(actor.node_id.remote())
        ids = list(fault_corpus.rollout_ids[: IO_THREADS - 2])  # threads left for the listing
        started = time.monotonic()
        batch = actor.freeze_batch.remote(directory, ids)
        listing = ray.get(actor.rollout_ids.remote(directory))  # answered while the batch blocks
        listed_after = time.monotonic() - started
        frozen = ray.get(batch)
        elapsed = time.monotonic() - started
        assert [_frozen_or_error(f) for f in frozen] == [_freeze_here(directory, rid) for rid in ids]
        assert ids[0] in listing
        assert listed_after < delay, "a blocking freeze serialised the actor"
        assert elapsed < len(ids) * delay / 2, f"{len(ids)} freezes of {delay} s took {elapsed:.2f} s"
    finally:
        ray.kill(actor)

    cluster.fleet([directory])
    # The resource view lags a little; an actor holding a CPU would never let it settle.
    deadline = time.monotonic() + 5
    while ray.available_resources().get("CPU") != ray.cluster_resources().get("CPU"):
        assert time.monotonic() < deadline, "the node actor holds a CPU slot"
        time.sleep(0.1)


def test_chain_delivery_rows_match_the_local_chain_builds(ray_shared, fault_corpus, corpus_copy):
    """delivery="chains" on Ray gives, rollout by rollout, the rows of raycap.rows.chains."""
    from raycap.rows.arrow import CHAIN_SCHEMA, chains_to_table
    from raycap.rows.chains import build_frozen_chains

    ray_dir, local = corpus_copy("chains-ray"), corpus_copy("chains-local")
    table = on_ray([ray_dir], delivery="chains")
    assert table.schema == CHAIN_SCHEMA
    ids = TokenCaptureStore(local).rollout_ids()
    store = TokenCaptureStore(local)
    expected = []
    for rid in ids:
        try:
            expected.append(build_frozen_chains(rid, [(ray_dir, store.freeze_raw(rid))]))
        except Exception as exc:  # noqa: BLE001 - freeze failures are masked rows on Ray too
            from raycap.capture.consumer import Metrics, RolloutBuild
            from raycap.rows.chains import ChainsBuild

            expected.append(ChainsBuild(RolloutBuild(rid, "prefix_merging", "", Metrics(0), error=f"{type(exc).__name__}: {exc}"), [], True))
    local_table = chains_to_table(expected, [[ray_dir]] * len(expected))
    columns = ["rollout_id", "chain_id", "mask_sample", "mask_reasons", "weight", "n_chains", "token_ids", "logprobs", "loss_mask"]
    got, want = table.select(columns).to_pylist(), local_table.select(columns).to_pylist()
    assert [r["rollout_id"] for r in got] == [r["rollout_id"] for r in want]
    assert got == want
    assert len(got) > len(ids)  # branches and compactions give several rows per rollout


def test_unknown_delivery_is_refused(ray_shared, tmp_path):
    with pytest.raises(ValueError, match="unknown delivery 'nope'"):
        on_ray([str(tmp_path)], delivery="nope")


def test_retirement_on_ray_drives_the_actors_from_here_a_few_steps_at_a_time(ray_shared):
    """Retiring starts no task (a task that takes no CPU gets a new worker process per task
    running at once): this process asks the directories' actors to drop, a few steps in
    flight, reports each step in order once its drops finished, and a step it cannot read
    drops nothing and says so."""
    import ray

    from raycap.capture.outcomes import DropOutcome
    from raycap.runs import retirement

    asked: list[str] = []

    class Handle:
        def drop_batch(self, items):
            asked.extend(rid for rid, _, _ in items)
            return ray.put([DropOutcome(dropped=True) for _ in items])

    def unreadable():
        raise OSError("shard gone")

    steps = [(f"s{k}", (lambda k=k: {"d": [(f"r{k}", "snap", 1)]})) for k in range(10)]
    steps.insert(3, ("bad", unreadable))
    reported: list[tuple[str, int, int]] = []

    def on_shard(name, report):
        reported.append((name, report.dropped, len(asked)))

    report = retirement._drop_in_flight(iter(steps), {"d": Handle()}, on_shard, what="shard ")
    assert [name for name, _, _ in reported] == [name for name, _ in steps]
    assert report.dropped == 10 and report.errors == ["shard bad: OSError: shard gone; nothing of it is known to be dropped, rerun to finish"]
    for finished, (_, _, submitted) in enumerate(reported):
        assert submitted - finished <= retirement.IN_FLIGHT  # never more than a few steps ahead
    assert "@ray.remote" not in Path(retirement.__file__).read_text()
