"""Placement by evidence: a plain path held by several nodes is one directory only when
the nodes see each other's marker files.

The multi-node tests add three worker nodes to the session's shared cluster (see
conftest) for the module: the driver's head node and node "n3" see the machine's file
system, while "n1" and "n2" each see their own root (the `raycap.test/root` seam), so one
plain path can name distinct directories. The nodes are removed after the module.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile

import pytest
import ray

from raycap.cluster.plumbing import placement
from raycap.cluster.plumbing.placement import MARKER_PREFIX, ROOT_LABEL, CaptureDir, locate

OLD_MTIME_NS = 1_000_000_000_000_000_000  # 2001: any marker written later moves it


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _markers(*directories: str) -> list[str]:
    return [m for d in directories for m in glob.glob(os.path.join(d, MARKER_PREFIX + "*"))]


def _make(directory: str, content: str) -> str:
    os.makedirs(directory)
    with open(os.path.join(directory, "r-1.jsonl"), "w") as f:
        f.write(content)
    os.utime(directory, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
    return directory


# --- the partition rule, without Ray ------------------------------------------------------


def test_partition_groups_holders_by_the_markers_they_see():
    # 0 and 2 share; 1 is alone; 3 sees 1's marker only.
    seen = [
        [True, False, True, False],
        [False, True, False, False],
        [True, False, True, False],
        [False, True, False, False],
    ]
    sharing = placement._partition([True, True, True, False], seen)
    assert sharing.groups == [[0, 2], [1, 3]]
    assert sharing.unresolved == [] and sharing.unanswered == []


def test_partition_leaves_holders_without_evidence_unresolved_and_silent_ones_unanswered():
    # 0 wrote and sees its own marker; 1 could not write and sees nothing; 2 did not
    # answer the check, but 0 sees 2's marker, so 2 shares 0's directory; 3 is silent.
    seen = [[True, False, True, False], [False, False, False, False], None, None]
    sharing = placement._partition([True, False, True, True], seen)
    assert sharing.groups == [[0, 2]]
    assert sharing.unresolved == [1]
    assert sharing.unanswered == [3]


def test_partition_without_any_marker_has_no_evidence():
    sharing = placement._partition([False, False], [[False, False], [False, False]])
    assert sharing.groups == [] and sharing.unresolved == [0, 1]


def test_local_path_is_the_identity_outside_ray_or_without_the_label():
    # The driver of a plain Ray instance carries no root label either.
    assert placement.local_path("/data/caps") == "/data/caps"
    assert placement.local_path("relative/dir") == "relative/dir"


# --- a simulated cluster: head and n3 share storage, n1 and n2 each have their own -------


@pytest.fixture(scope="module")
def nodes(ray_cluster):
    """(node ids by name, n1's root, n2's root, a scratch directory on the shared file system)."""
    base = tempfile.mkdtemp(prefix="raycap-placement-")
    roots = {name: os.path.join(base, f"root-{name}") for name in ("n1", "n2")}
    labels = [{"raycap-node": name, **({ROOT_LABEL: roots[name]} if name in roots else {})} for name in ("n1", "n2", "n3")]
    try:
        with ray_cluster.nodes(labels):
            ray_cluster.connect(fresh=True)
            node_of = ray_cluster.node_ids()
            assert ray.get_runtime_context().get_node_id() == node_of["head"]
            yield node_of, roots["n1"], roots["n2"], os.path.join(base, "data")
    finally:
        ray.shutdown()
        shutil.rmtree(base, ignore_errors=True)


@ray.remote(num_cpus=0)
def _local_path_on_node(path: str) -> str:
    return placement.local_path(path)


def _on(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return _local_path_on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


@pytest.mark.slow
def test_local_path_maps_absolute_paths_under_the_node_root(nodes):
    node_of, root1, _, _ = nodes
    assert ray.get(_on(node_of["n1"]).remote("/data/caps")) == os.path.join(root1, "data/caps")
    assert ray.get(_on(node_of["n1"]).remote("relative/caps")) == "relative/caps"
    assert ray.get(_on(node_of["n3"]).remote("/data/caps")) == "/data/caps"
    assert placement.local_path("/data/caps") == "/data/caps"  # the driver's node has no root


@pytest.mark.slow
def test_distinct_directories_under_one_plain_path_are_each_served(nodes):
    node_of, root1, root2, data = nodes
    path = os.path.join(data, "split")
    held = [_make(_under(root1, path), "n1's rollouts"), _make(_under(root2, path), "n2's rollouts")]

    placed = locate([path])

    # In ray.nodes() order, which need not be the order the nodes were added in.
    by_node = {node: d for d, node in placed}
    assert len(placed) == 2 and set(by_node) == {node_of["n1"], node_of["n2"]}
    assert all(d == CaptureDir(path, node) for node, d in by_node.items())
    assert {d.label for d in by_node.values()} == {f"{node_of['n1']}:{path}", f"{node_of['n2']}:{path}"}
    # Each label is a spec that places its directory alone, on its node.
    assert [locate([d.label]) for d, _ in placed] == [[entry] for entry in placed]
    assert _markers(*held) == []


@pytest.mark.slow
def test_a_sink_or_source_of_a_path_several_nodes_hold_apart_is_refused_before_any_actor_starts(nodes):
    from raycap.cluster.nodes.actor import running_actor
    from raycap.cluster.nodes.fleet import RayTokenSource
    from raycap.cluster.sink import RayTokenSink

    node_of, root1, root2, data = nodes
    path = os.path.join(data, "split-writers")
    _make(_under(root1, path), "n1's rollouts")
    _make(_under(root2, path), "n2's rollouts")
    assert running_actor(node_of["n1"]) is None and running_actor(node_of["n2"]) is None
    for served in (RayTokenSink, RayTokenSource):
        with pytest.raises(ValueError, match=f"held separately by several nodes .*{served.__name__} serves one directory"):
            served(capture_dir=path)
    assert running_actor(node_of["n1"]) is None and running_actor(node_of["n2"]) is None


@pytest.mark.slow
def test_the_driver_serves_the_group_it_shares_and_each_other_directory_is_served_too(nodes):
    node_of, root1, root2, data = nodes
    path = os.path.join(data, "mixed")
    held = [_make(path, "shared"), _make(_under(root1, path), "n1"), _make(_under(root2, path), "n2")]

    placed = locate([path])

    # head and n3 share the directory (one entry, from the driver's node); n1 and n2
    # hold their own.
    assert sorted(node for _, node in placed) == sorted(node_of[n] for n in ("head", "n1", "n2"))
    assert {d.label for d, _ in placed} == {f"{node}:{path}" for _, node in placed}
    assert _markers(*held) == []


@pytest.mark.slow
def test_a_path_on_shared_storage_is_served_once_under_its_plain_label(nodes):
    node_of, root1, root2, data = nodes
    path = _make(os.path.join(data, "shared"), "everyone's rollouts")

    placed = locate([path])

    assert placed == [(CaptureDir(path), node_of["head"])]
    assert placed[0][0].label == path
    assert _markers(path) == []
    # The marker check proved n3 sees the same directory: naming it again on n3 would
    # build its rollouts twice.
    with pytest.raises(ValueError, match="same directory"):
        locate([path, f"raycap-node=n3:{path}"])
    assert _markers(path) == []


@pytest.mark.slow
def test_a_path_on_one_node_writes_no_marker(nodes):
    node_of, root1, _, data = nodes
    path = os.path.join(data, "only-n1")
    held = _make(_under(root1, path), "n1's rollouts")

    assert locate([path]) == [(CaptureDir(path), node_of["n1"])]
    assert locate([f"raycap-node=n1:{path}"]) == [(CaptureDir(path, "raycap-node=n1"), node_of["n1"])]
    assert os.stat(held).st_mtime_ns == OLD_MTIME_NS  # no marker was ever created there
    assert _markers(held) == []


@pytest.mark.slow
def test_an_explicit_spec_on_a_node_of_its_own_is_placed_as_given(nodes):
    node_of, _, root2, data = nodes
    path = _make(os.path.join(data, "explicit"), "shared")
    held = _make(_under(root2, path), "n2's own")

    placed = locate([f"raycap-node=n2:{path}", f"{node_of['n3']}:{path}"])

    assert placed == [
        (CaptureDir(path, "raycap-node=n2"), node_of["n2"]),
        (CaptureDir(path, node_of["n3"]), node_of["n3"]),
    ]
    assert os.stat(held).st_mtime_ns == os.stat(path).st_mtime_ns == OLD_MTIME_NS
    assert _markers(path, held) == []


@pytest.mark.slow
def test_a_directory_where_no_marker_can_be_written_is_taken_as_shared_with_a_warning(nodes, caplog):
    node_of, _, _, _ = nodes
    # sysfs refuses new files, even to root; head and n3 hold /sys, n1 and n2 do not.
    readonly = "/sys"
    try:
        os.close(os.open(os.path.join(readonly, MARKER_PREFIX + "test"), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except OSError:
        pass
    else:
        os.unlink(os.path.join(readonly, MARKER_PREFIX + "test"))
        pytest.skip("/sys accepts new files here")

    with caplog.at_level(logging.WARNING, logger=placement.__name__):
        placed = locate([readonly])

    assert placed == [(CaptureDir(readonly), node_of["head"])]
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert readonly in warning and "NODE:PATH" in warning
