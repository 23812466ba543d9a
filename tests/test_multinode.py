"""The durable handoff on a simulated multi-node cluster (`ray.cluster_utils.Cluster`).

Builder tasks on two worker nodes write their shards into one staging directory and one
commit covers them all; a node that cannot see the staging directory as the driver does
stops the run, with a one-line reason, before anything is built, committed or retired.

The simulated nodes share this machine's file system, which is what a shared output
needs. To learn which node wrote each shard, every worker process of the test's job
records it (a `worker_process_setup_hook` wraps `raycap.output.write_shard`). The node
that cannot see the staging directory is made with the placement test seam
(`raycap.cluster.placement.ROOT_LABEL`): on it every path resolves under a root of its
own.

The module shuts the shared Ray instance down, runs its own cluster and leaves Ray shut
down; `ray_shared` starts the shared one again for whoever needs it next.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray

import raycap
from raycap.cluster.placement import ROOT_LABEL
from raycap.handoff import rebuild_to_output
from raycap.output import OutputError, is_committed, read_manifest, staging_path, summary_path
from raycap.synth import CorpusSpec, generate_corpus

pytestmark = pytest.mark.slow

SMALL_FAULTS = dict(fault_share=0.5, system_tokens=(50, 200), turns=(4, 8), generation_tokens=(1, 40), tool_tokens=(1, 60))
NODE_ARGS = dict(num_cpus=1, object_store_memory=100 << 20)
WORKERS = ("w1", "w2")


def _recording_hook(record_dir: str):
    """A worker setup hook: each shard a worker writes leaves `<shard name>.<node id>`
    in `record_dir`. (A closure, so Ray ships it by value to every node's workers.)"""

    def hook() -> None:
        import importlib

        import ray as worker_ray

        output = importlib.import_module("raycap.output")
        original = output.write_shard

        def write_shard(staging_dir, index, table):
            info = original(staging_dir, index, table)
            node = worker_ray.get_runtime_context().get_node_id()
            open(os.path.join(record_dir, f"{info.name}.{node}"), "w").close()
            return info

        output.write_shard = write_shard

    return hook


@pytest.fixture(scope="module")
def cluster():
    """(Cluster, node id by name, the directory where shard writers are recorded): a
    head and two worker nodes, one CPU each, this process connected as the driver."""
    from ray.cluster_utils import Cluster

    ray.shutdown()
    ray_tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths must fit
    records = tempfile.mkdtemp(prefix="raycap-writers-")
    nodes = None
    with pytest.MonkeyPatch.context() as patch:
        # A private Ray temp dir: the cluster must not touch another Ray's address file.
        patch.setenv("RAY_TMPDIR", ray_tmp)
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.delenv("RAY_ADDRESS", raising=False)
        try:
            nodes = Cluster(
                initialize_head=True,
                head_node_args={**NODE_ARGS, "include_dashboard": False, "labels": {"raycap-node": "head"}},
            )
            for name in WORKERS:
                nodes.add_node(**NODE_ARGS, labels={"raycap-node": name})
            ray.init(
                address=nodes.address,
                logging_level=logging.WARNING,
                runtime_env={"worker_process_setup_hook": _recording_hook(records)},
            )
            nodes.wait_for_nodes()
            node_of = {n["Labels"]["raycap-node"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
            yield nodes, node_of, Path(records)
        finally:
            ray.shutdown()
            if nodes is not None:
                nodes.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
            shutil.rmtree(records, ignore_errors=True)


def _states(directory: Path) -> dict[str, dict]:
    suffix = ".tokens.state.json"
    return {p.name[: -len(suffix)]: json.loads(p.read_text()) for p in directory.glob("*" + suffix)}


def _retired(directory: Path) -> set[str]:
    return {rid for rid, state in _states(directory).items() if state.get("retired")}


def _frozen(directory: Path) -> set[str]:
    return {rid for rid, state in _states(directory).items() if state.get("frozen")}


def test_builder_tasks_on_two_nodes_write_shards_that_one_commit_covers(cluster, tmp_path, comparable):
    nodes, node_of, records = cluster
    dirs = {name: tmp_path / name for name in WORKERS}
    copies = {name: tmp_path / f"{name}-copy" for name in WORKERS}
    for seed, name in enumerate(WORKERS):
        generate_corpus(dirs[name], CorpusSpec(rollouts=8, seed=40 + seed, id_prefix=f"{name}-", **SMALL_FAULTS))
        shutil.copytree(dirs[name], copies[name])
    before = {name: _retired(dirs[name]) for name in WORKERS}
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
        writers.setdefault(shard + ".parquet", set()).add(node)
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
        assert _retired(dirs[name]) == before[name] | {rid for rid in unmasked if rid.startswith(f"{name}-")}


def test_a_node_that_cannot_see_the_staging_directory_stops_the_run_before_any_work(cluster, tmp_path):
    nodes, node_of, _ = cluster
    # A third worker whose file system is its own: every path resolves under `root` there.
    root = tempfile.mkdtemp(prefix="raycap-own-disk-")
    apart = nodes.add_node(**NODE_ARGS, labels={"raycap-node": "w3", ROOT_LABEL: root})
    try:
        nodes.wait_for_nodes()
        captures = tmp_path / "captures"
        generate_corpus(captures, CorpusSpec(rollouts=6, seed=7, **SMALL_FAULTS))
        spec = f"{node_of['w1']}:{captures}"
        output = tmp_path / "out" / "rows"
        retired, frozen = _retired(captures), _frozen(captures)

        def attempt() -> str:
            with pytest.raises(OutputError) as failure:
                rebuild_to_output([spec], output, model="m", executor="ray", batch_size=2, retire=True)
            message = str(failure.value)
            assert "\n" not in message
            # Nothing built, committed or retired; the staging directory is gone again.
            assert not output.exists() and not staging_path(output).exists()
            assert not summary_path(output).exists()
            assert _retired(captures) == retired and _frozen(captures) == frozen
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
    finally:
        nodes.remove_node(apart)
        shutil.rmtree(root, ignore_errors=True)
