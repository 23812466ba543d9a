"""The durable handoff on a simulated multi-node cluster (`ray.cluster_utils.Cluster`).

Builder tasks on two worker nodes write their shards into one staging directory and one
commit covers them all; a node that cannot see the staging directory as the driver does
stops the run, with a one-line reason, before anything is built, committed or retired.

The simulated nodes share this machine's file system, which is what a shared output
needs. To learn which node wrote each shard, every worker process of the test's job
records it (a `worker_process_setup_hook` wraps `raycap.output.shards.write_shard`). The node
that cannot see the staging directory is made with the placement test seam
(`raycap.cluster.plumbing.placement.ROOT_LABEL`): on it every path resolves under a root of its
own.

With the output on S3 (the test server, see tests/s3server.py) no node needs to see
another's files: a node with a disk of its own builds and writes its shards straight to
the store.

The module adds its two worker nodes to the session's shared cluster (see conftest) and
connects a driver of its own, with the recording hook; both are gone after the module.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray

import raycap
from conftest import frozen_ids, retired_ids
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.cluster.plumbing.placement import ROOT_LABEL
from raycap.output.commit import staging_path, summary_path
from raycap.output.faults import OutputError
from raycap.output.manifest import is_committed, read_manifest
from raycap.output.shards import DATA_DIR
from raycap.runs.handoff import rebuild_to_output

pytestmark = pytest.mark.slow

SMALL_FAULTS = dict(fault_share=0.5, system_tokens=(50, 200), turns=(4, 8), generation_tokens=(1, 40), tool_tokens=(1, 60))
WORKERS = ("w1", "w2")


def _recording_hook(record_dir: str):
    """A worker setup hook: each shard a worker writes leaves `<shard name>.<node id>`
    in `record_dir`. (A closure, so Ray ships it by value to every node's workers.)"""

    def hook() -> None:
        import importlib

        import ray as worker_ray

        shards = importlib.import_module("raycap.output.shards")
        original = shards.write_shard

        def write_shard(staging_dir, index, table):
            info = original(staging_dir, index, table)
            node = worker_ray.get_runtime_context().get_node_id()
            # Shard names carry the output's data/ directory: the mark keeps only the file name.
            open(os.path.join(record_dir, f"{os.path.basename(info.name)}.{node}"), "w").close()
            return info

        shards.write_shard = write_shard

    return hook


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """(the session's RayCluster, node id by name, the directory where shard writers are
    recorded): the head and two worker nodes of one CPU each, this process the driver."""
    records = tempfile.mkdtemp(prefix="raycap-writers-")
    try:
        with ray_cluster.nodes([{"raycap-node": name} for name in WORKERS]):
            ray_cluster.connect({"worker_process_setup_hook": _recording_hook(records)}, fresh=True)
            yield ray_cluster, ray_cluster.node_ids(), Path(records)
    finally:
        ray.shutdown()
        shutil.rmtree(records, ignore_errors=True)


@pytest.fixture(scope="module")
def apart(cluster):
    """(node, root): a third worker, raycap-node=w3, whose file system is its own: every
    path resolves under `root` there. Started for the first test that asks for it (after
    the two-node test, which needs every node to see the staging directory) and kept for
    the module: the tests that use it write under their own tmp_path, below `root`."""
    nodes, _, _ = cluster
    root = tempfile.mkdtemp(prefix="raycap-own-disk-")
    node = nodes.add_node(labels={"raycap-node": "w3", ROOT_LABEL: root})
    try:
        yield node, root
    finally:
        nodes.remove_node(node)
        shutil.rmtree(root, ignore_errors=True)


def test_builder_tasks_on_two_nodes_write_shards_that_one_commit_covers(cluster, tmp_path, comparable):
    nodes, node_of, records = cluster
    dirs = {name: tmp_path / name for name in WORKERS}
    copies = {name: tmp_path / f"{name}-copy" for name in WORKERS}
    for seed, name in enumerate(WORKERS):
        generate_corpus(dirs[name], CorpusSpec(rollouts=8, seed=40 + seed, id_prefix=f"{name}-", **SMALL_FAULTS))
        shutil.copytree(dirs[name], copies[name])
    before = {name: retired_ids(dirs[name]) for name in WORKERS}
    # Each directory is pinned to the worker node whose model servers "wrote" it.
    specs = [f"{node_of[name]}:{dirs[name]}" for name in WORKERS]
    output = tmp_path / "out" / "rows"

    outcome = rebuild_to_output(specs, output, model="m", executor="ray", batch_size=2, retire=True)

    assert outcome.ok, outcome.message
    assert outcome.summary.executor.name == "ray"
    assert is_committed(output) and not staging_path(output).exists()
    manifest = read_manifest(output)
    writers: dict[str, set[str]] = {}
    for mark in records.iterdir():
        shard, node = mark.name.split(".parquet.")
        writers.setdefault(f"{DATA_DIR}/{shard}.parquet", set()).add(node)
    # One commit covers shards written by builder tasks on both worker nodes, and each
    # directory's rollouts were built on the node that holds it.
    assert {shard.name for shard in manifest.shards} <= set(writers)
    for shard in manifest.shards:
        ids = pq.read_table(output / shard.name, columns=["rollout_id"]).column(0).to_pylist()
        homes = {node_of[rid.split("-")[0]] for rid in ids}
        assert len(homes) == 1 and writers[shard.name] == homes, shard.name
    assert {node_of[name] for name in WORKERS} <= set().union(*(writers[s.name] for s in manifest.shards))
    table = pq.read_table(output)
    assert manifest.totals.rows == table.num_rows == sum(shard.rows for shard in manifest.shards)
    assert json.loads(summary_path(output).read_text())["rollouts"] == table.num_rows

    # The same rows as a single-node build of copies, in this process.
    want = raycap.rebuild([str(copies[name]) for name in WORKERS], model="m", executor="local", skip_retired=True)
    assert table.column("rollout_id").to_pylist() == want.column("rollout_id").to_pylist()
    for got, expected in zip(raycap.builds_from_table(table), raycap.builds_from_table(want)):
        home = got["rollout_id"].split("-")[0]
        assert comparable(got, dirs[home]) == comparable(expected, copies[home]), got["rollout_id"]
    # Retired through each node's actor: exactly the unmasked rows.
    unmasked = {r["rollout_id"] for r in table.select(["rollout_id", "mask_sample"]).to_pylist() if not r["mask_sample"]}
    assert unmasked
    for name in WORKERS:
        assert retired_ids(dirs[name]) == before[name] | {rid for rid in unmasked if rid.startswith(f"{name}-")}


def test_a_node_that_cannot_see_the_staging_directory_stops_the_run_before_any_work(cluster, apart, tmp_path):
    nodes, node_of, _ = cluster
    # A third worker whose file system is its own (`apart`): every path resolves under `root` there.
    _, root = apart
    captures = tmp_path / "captures"
    generate_corpus(captures, CorpusSpec(rollouts=6, seed=7, **SMALL_FAULTS))
    spec = f"{node_of['w1']}:{captures}"
    output = tmp_path / "out" / "rows"
    retired, frozen = retired_ids(captures), frozen_ids(captures)

    def attempt() -> str:
        with pytest.raises(OutputError) as failure:
            rebuild_to_output([spec], output, model="m", executor="ray", batch_size=2, retire=True)
        message = str(failure.value)
        assert "\n" not in message
        # Nothing built, committed or retired; the staging directory is gone again.
        assert not output.exists() and not staging_path(output).exists()
        assert not summary_path(output).exists()
        assert retired_ids(captures) == retired and frozen_ids(captures) == frozen
        return message

    # Its disk has no directory at the staging path: it cannot even write there.
    message = attempt()
    assert "cannot write into the output's staging directory" in message
    assert "put the output on a file system every node mounts" in message
    # Its disk has a directory of its own at that path: it writes there, unseen by the others.
    os.makedirs(os.path.join(root, str(staging_path(output)).lstrip("/")))
    message = attempt()
    assert f"the output {output.parent} is not on storage every node shares" in message
    assert "put the output on a shared file system" in message


def test_nodes_that_share_no_directory_write_their_shards_straight_to_s3(cluster, apart, s3, s3_bucket, tmp_path, comparable):
    """The output on S3: no node needs to see another's files. A third worker has a
    disk of its own (every path resolves under its root there), which a local output
    refuses (the test above); on S3 its builder tasks PUT their shards to the store."""
    nodes, _, records = cluster
    for mark in records.iterdir():
        mark.unlink()
    _, root = apart
    node_of = nodes.node_ids()
    shared = tmp_path / "w1"  # on w1, seen as it is
    own = tmp_path / "w3"  # on w3: under its own root
    real = Path(root, str(own).lstrip("/"))
    generate_corpus(shared, CorpusSpec(rollouts=6, seed=50, id_prefix="w1-", **SMALL_FAULTS))
    generate_corpus(real, CorpusSpec(rollouts=6, seed=51, id_prefix="w3-", **SMALL_FAULTS))
    copies = {"w1": tmp_path / "w1-copy", "w3": tmp_path / "w3-copy"}
    shutil.copytree(shared, copies["w1"])
    shutil.copytree(real, copies["w3"])
    before = {"w1": retired_ids(shared), "w3": retired_ids(real)}
    uri = f"s3://{s3_bucket}/multi/rows"

    outcome = rebuild_to_output(
        [f"{node_of['w1']}:{shared}", f"{node_of['w3']}:{own}"], uri, model="m", executor="ray", batch_size=2,
        retire=True,
    )

    assert outcome.ok, outcome.message
    manifest = read_manifest(uri)
    writers: dict[str, set[str]] = {}
    for mark in records.iterdir():
        shard, node = mark.name.split(".parquet.")
        writers.setdefault(f"{DATA_DIR}/{shard}.parquet", set()).add(node)
    table = pq.read_table(uri)
    by_shard = {
        shard.name: {rid.split("-")[0] for rid in pq.read_table(f"{uri}/{shard.name}", columns=["rollout_id"]).column(0).to_pylist()}
        for shard in manifest.shards
    }
    # Every shard was written by a builder task straight to the store, on several nodes
    # (a task may run beside its captures or read them through their node's actor).
    assert set(by_shard) <= set(writers) and all(len(homes) == 1 for homes in by_shard.values())
    names = {node: name for name, node in node_of.items()}
    assert len({names.get(node, node) for shard in by_shard for node in writers[shard]}) >= 2, writers

    want = raycap.rebuild([str(copies["w1"]), str(copies["w3"])], model="m", executor="local", skip_retired=True)
    assert table.column("rollout_id").to_pylist() == want.column("rollout_id").to_pylist()
    for got, expected in zip(raycap.builds_from_table(table), raycap.builds_from_table(want)):
        home = got["rollout_id"].split("-")[0]
        mine, version = comparable(got, real if home == "w3" else shared)
        if mine and mine.get("error"):  # w3's errors may name its directory as given, or as it is there
            mine["error"] = mine["error"].replace(str(own), "<dir>")
        assert (mine, version) == comparable(expected, copies[home]), got["rollout_id"]
    unmasked = {r["rollout_id"] for r in table.select(["rollout_id", "mask_sample"]).to_pylist() if not r["mask_sample"]}
    assert retired_ids(shared) == before["w1"] | {rid for rid in unmasked if rid.startswith("w1-")}
    assert retired_ids(real) == before["w3"] | {rid for rid in unmasked if rid.startswith("w3-")}


def test_an_empty_directory_here_is_left_to_the_actors_while_other_nodes_are_alive(cluster, tmp_path):
    # Other nodes may hold directories of their own under this path: an empty one here
    # says nothing of theirs, so a job refusing empty input asks the actors as before.
    from raycap.capture.directory import CaptureDir
    from raycap.rows.options import RebuildOptions
    from raycap.runs.handoff import nothing_here

    (tmp_path / "captures").mkdir()
    dirs = (CaptureDir.parse(str(tmp_path / "captures")),)
    assert ray.is_initialized()
    assert not nothing_here(dirs, None, RebuildOptions(executor="ray", skip_retired=True), None)
