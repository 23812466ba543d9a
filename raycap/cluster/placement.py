"""Where capture directories live: matching them to Ray nodes before any actor starts.

A capture directory is local to the node whose model servers wrote it, so the actor
that serves it must run there. A directory is given either as a plain absolute path,
which raycap locates by probing every alive node, or as `NODE:PATH` (or a mapping with
`node` and `path`), where NODE is matched against, in this order:

- a node id (the hex `ray.io/node-id`),
- a node IP address or hostname,
- a label `key=value` (for example `ray.io/node-id=...` or `rack=a3`).

A plain path present on several nodes is taken to be shared storage and served from
one of them (the driver's node when it has the path, else the first alive node that
has it); give `NODE:PATH` per node when several nodes hold different directories under
the same path. A directory that no alive node has, or a node matcher that matches no
alive node, is an error raised up front: an actor pinned to nowhere would otherwise
wait forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CaptureDir:
    """A capture directory and, optionally, the node that holds it."""

    path: str
    node: str | None = None

    @property
    def label(self) -> str:
        """How rows and logs name this directory."""
        return self.path if self.node is None else f"{self.node}:{self.path}"

    @classmethod
    def parse(cls, spec: Any) -> "CaptureDir":
        if isinstance(spec, CaptureDir):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"path", "node"}
            if unknown or "path" not in spec:
                raise ValueError(
                    f"capture directory {dict(spec)!r}: expected keys 'path' and optionally 'node'"
                )
            path, node = str(spec["path"]), spec.get("node")
        else:
            text = os.fspath(spec)
            node = None
            path = text
            if not text.startswith("/") and ":/" in text:
                node, path = text.split(":/", 1)
                path = "/" + path
        if not os.path.isabs(path):
            raise ValueError(
                f"capture directory {spec!r} is not an absolute path; give /abs/path or NODE:/abs/path"
            )
        return cls(os.path.normpath(path), str(node) if node else None)


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _matches(node: dict, matcher: str) -> bool:
    if matcher in (node["NodeID"], node.get("NodeManagerAddress"), node.get("NodeManagerHostname")):
        return True
    if "=" in matcher:
        key, value = matcher.split("=", 1)
        return (node.get("Labels") or {}).get(key) == value
    return False


@ray.remote(num_cpus=0, max_retries=0)
def _probe(path: str) -> bool:
    return os.path.isdir(path)


def _probe_nodes(path: str, nodes: list[dict]) -> list[dict]:
    refs = [
        _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(path)
        for n in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    ready_set = set(ready)
    found = []
    for node, ref in zip(nodes, refs):
        if ref in ready_set:
            try:
                if ray.get(ref):
                    found.append(node)
            except ray.exceptions.RayError:
                continue  # a node dying mid-probe just does not hold the directory
    return found


def locate(dirs: Iterable[Any]) -> list[tuple[CaptureDir, str]]:
    """Parse directory specs and return each with the id of the node that will serve it."""
    parsed = [CaptureDir.parse(d) for d in dirs]
    if not parsed:
        raise ValueError("no capture directories given")
    labels = [d.label for d in parsed]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"capture directories listed twice: {', '.join(duplicates)}")
    nodes = _alive_nodes()
    here = ray.get_runtime_context().get_node_id()
    placed = []
    for d in parsed:
        candidates = nodes
        if d.node is not None:
            candidates = [n for n in nodes if _matches(n, d.node)]
            if not candidates:
                known = ", ".join(f"{n['NodeID'][:12]}.. ({n.get('NodeManagerAddress')})" for n in nodes)
                raise ValueError(
                    f"capture directory {d.label}: node {d.node!r} matches no alive Ray node "
                    f"(alive: {known}); use a node id, IP, hostname or key=value label"
                )
        holders = _probe_nodes(d.path, candidates)
        if not holders:
            where = f"node {d.node!r}" if d.node else f"any of the {len(candidates)} alive Ray nodes"
            raise ValueError(
                f"capture directory {d.path} does not exist on {where}; check the path, or give "
                "NODE:PATH for a directory that lives on a node not yet in the cluster"
            )
        chosen = next((n for n in holders if n["NodeID"] == here), holders[0])
        placed.append((d, chosen["NodeID"]))
    return placed
