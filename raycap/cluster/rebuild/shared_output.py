"""The output's staging directory must be one directory for every node that builds.

Builder tasks write their shards where they run and the driver commits them, so a node
that cannot see the staging directory as the driver does would lose its shards at the
commit. `check_shared_output` proves it before any work, with marker files as
placement does (`raycap.cluster.plumbing.placement`), and raises OutputError naming the node.
"""

from __future__ import annotations

import os
import uuid

import ray

from raycap.cluster.plumbing.placement import (
    MARKER_PREFIX,
    _ask,
    _remove_markers,
    _seen_markers,
    _write_marker,
    local_path,
)


def check_shared_output(staging_dir: str) -> None:
    """Raise OutputError unless every node that can run builder tasks sees `staging_dir`
    as the driver does: shards are written where they are built, and the commit must
    find them all. Each node writes a marker (as placement does), then every node and
    the driver look for all of them; each writer removes its own."""
    from raycap.output.faults import OutputError  # (builder workers never need the output module)

    here = ray.get_runtime_context().get_node_id()
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and (n.get("Resources") or {}).get("CPU", 0) > 0]
    if not nodes or nodes == [here]:
        return  # one node: the driver's own file system
    names = [f"{MARKER_PREFIX}{uuid.uuid4().hex}" for _ in nodes]
    wrote = _ask([(node, _write_marker, (staging_dir, name)) for node, name in zip(nodes, names)])
    try:
        for node, answer in zip(nodes, wrote):
            if answer is not None:
                why = answer if isinstance(answer, str) else "it did not answer"
                raise OutputError(
                    f"node {node[:12]}.. cannot write into the output's staging directory {staging_dir} ({why}); "
                    "put the output on a file system every node mounts, writable by the Ray workers"
                )
        seen = _ask([(node, _seen_markers, (staging_dir, names)) for node in nodes])
        seen.append([os.path.lexists(os.path.join(local_path(staging_dir), name)) for name in names])
        for viewer, row in zip([*nodes, None], seen):
            missing = [node for node, ok in zip(nodes, row if isinstance(row, list) else [False] * len(nodes)) if not ok]
            if missing:
                who = "the driver" if viewer is None else f"node {viewer[:12]}.."
                raise OutputError(
                    f"the output {os.path.dirname(staging_dir) or '.'} is not on storage every node shares: {who} "
                    f"cannot see what node {missing[0][:12]}.. wrote into {staging_dir}; put the output on a shared "
                    "file system (e.g. NFS) mounted at the same path on every node"
                )
    finally:
        _ask([(node, _remove_markers, (staging_dir, [name])) for node, name in zip(nodes, names)])
