"""One driver process, two clusters one after another (a head restart, a test suite with a
cluster per module): each is served fully by `rebuild_refs`, `raycap.rebuild` and a stream
over `NODE:/path` directories, with nothing kept from the cluster before. Run in a child
process with clusters of its own, so the shared cluster of this process is never disturbed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import raycap

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# The child imports this module and the stream tests' helpers, so it has the path pytest has
# (pyproject.toml): the checkout, tests/ and every test folder.
CHILD_PATH = (ROOT, TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name.isidentifier()
                                   and not p.name.startswith("_")))


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, CHILD_PATH))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


# --- two clusters in one driver process --------------------------------------------------------


ATTEMPTS = 4  # to start one cluster


def _descendants(pid: int) -> list[int]:
    """The processes started by `pid`, and by them, in turn."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            child = int(stat.parent.name)
            found += [child, *_descendants(child)]
    return found


def _start_cluster():
    """A 2-node cluster (head raycap-node=a, worker b), started again when a node timed
    out while starting (Ray waits 30 s for a raylet to register, which a loaded machine can miss):
    this test is about what the driver keeps, not about how fast nodes start."""
    from ray.cluster_utils import Cluster

    for attempt in range(ATTEMPTS):
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=1, object_store_memory=80 << 20, include_dashboard=False,
                             labels={"raycap-node": "a"})
            cluster.add_node(num_cpus=1, object_store_memory=80 << 20, labels={"raycap-node": "b"})
            cluster.wait_for_nodes()
            return cluster
        except Exception:
            cluster.shutdown()
            for leftover in _descendants(os.getpid()):  # what the node that never registered started
                try:
                    os.kill(leftover, signal.SIGKILL)
                except OSError:
                    pass
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(10)


CLUSTERS = 2  # the second meets every cache the first left in this process


def clusters_in_turn(work: str) -> None:
    """In this process, two clusters in turn (2 nodes each, the head labelled
    raycap-node=a, the worker b), each served by `rebuild_refs`, `raycap.rebuild` and a
    stream over `NODE:/path` directories: node-id specs for the Rebuilder, label specs
    (the same text on every cluster) for `raycap.rebuild` and the stream."""
    import logging
    import shutil
    import tempfile

    import pyarrow as pa
    import ray

    from raycap import TokenCaptureStore
    from test_stream import write

    dirs = {name: os.path.join(work, name) for name in "ab"}
    for round_ in range(CLUSTERS):
        temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths must fit
        os.environ["RAY_TMPDIR"] = temp
        cluster = None
        try:
            cluster = _start_cluster()
            ray.init(address=cluster.address, logging_level=logging.WARNING)
            node_of = {n["Labels"]["raycap-node"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
            ids = {name: [f"{name}{round_}-{i}" for i in range(4)] for name in "ab"}
            for name in "ab":
                store = TokenCaptureStore(dirs[name])
                for rid in ids[name]:
                    write(store, rid)
            by_id = [f"{node_of[name]}:{dirs[name]}" for name in "ab"]
            by_label = [f"raycap-node={name}:{dirs[name]}" for name in "ab"]

            wanted = [ids["a"][0], ids["b"][0], ids["a"][1], ids["b"][1]]
            refs = raycap.Rebuilder(by_id, executor="ray").rebuild_refs(wanted)
            table = pa.concat_tables(ray.get(refs))
            assert table.column("rollout_id").to_pylist() == wanted, (round_, "rebuild_refs")
            assert not any(table.column("mask_sample").to_pylist()), (round_, table.column("error").to_pylist())

            wanted = [ids["b"][2], ids["a"][2]]
            table = raycap.rebuild(by_label, wanted, executor="ray")
            assert table.column("rollout_id").to_pylist() == wanted, (round_, "rebuild")
            assert not any(table.column("mask_sample").to_pylist()), (round_, table.column("error").to_pylist())

            every = sorted(ids["a"] + ids["b"])
            with raycap.Stream(by_label) as stream:
                submitted = stream.submit(every)
                assert sorted(submitted.ready) == every, (round_, submitted)
                got: list[str] = []
                deadline = time.monotonic() + 120
                while len(got) < len(every) and time.monotonic() < deadline:
                    rows = stream.take(len(every) - len(got), timeout=10)
                    if rows.num_rows:
                        assert not any(rows.column("mask_sample").to_pylist()), (round_, "stream")
                        stream.commit(rows)
                        got += rows.column("rollout_id").to_pylist()
                assert sorted(got) == every, (round_, "stream", got)
            print(f"cluster {round_}: served", flush=True)
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_two_clusters_in_turn_are_each_served_by_one_driver_process(tmp_path):
    script = textwrap.dedent(f"""
        import test_clusters_in_turn
        test_clusters_in_turn.clusters_in_turn({str(tmp_path)!r})
    """)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=_child_env(),
            cwd=str(tmp_path),
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"two clusters in turn did not finish in 900 s: {(exc.stdout or '')[-2000:]}")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert [line for line in done.stdout.splitlines() if line.startswith("cluster ")] == [
        f"cluster {k}: served" for k in range(CLUSTERS)
    ]
