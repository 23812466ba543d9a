"""Where capture directories live: matching them to Ray nodes before any actor starts.

A capture directory is local to the node whose model servers wrote it, so the actor
that serves it (its node's actor) must run there. A directory is given either as a plain absolute path,
which raycap locates by probing every alive node, or as `NODE:PATH` (or a mapping with
`node` and `path`), where NODE is matched against every alive node's

- node id (the hex `ray.io/node-id`),
- IP address or hostname,
- labels, written `key=value` (for example `rack=a3` or `ray.io/node-id=...`).

The rule for a path found on several nodes: it is served from the driver's node when
the driver's node has it, else from the first holder in `ray.nodes()` order. Such a
path is taken to be shared storage (every node sees the same files), so one node's actor is
enough and the driver's node is the cheapest place for it. When several nodes hold
*different* directories under the same path, give each as `NODE:PATH`; a plain path
would serve only one of them.

Placement fails up front, with a ValueError naming the directory, when the directory
exists on no candidate node or the node matcher matches no alive node: an actor pinned
to a node that does not hold its directory would otherwise wait forever or serve
nothing. Two specs that resolve to the same directory on the same node are refused
too, because the rollouts in it would be counted twice.
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
    """A capture directory and, optionally, the node matcher that says where it lives."""

    path: str
    node: str | None = None

    @property
    def label(self) -> str:
        """How rows, retirement and logs name this directory (the spec it was given as)."""
        return self.path if self.node is None else f"{self.node}:{self.path}"

    @classmethod
    def parse(cls, spec: Any) -> "CaptureDir":
        """Read `/abs/path`, `NODE:/abs/path`, a mapping {path, node} or a CaptureDir."""
        if isinstance(spec, CaptureDir):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"path", "node"}
            if unknown or "path" not in spec:
                raise ValueError(
                    f"capture directory {dict(spec)!r}: expected keys 'path' and optionally 'node'"
                )
            path, node = os.fspath(spec["path"]), spec.get("node")
        else:
            text = os.fspath(spec)
            node, path = None, text
            # A plain path may itself contain ":/"; only a spec that does not start with
            # "/" carries a node part.
            if not text.startswith("/") and ":/" in text:
                node, rest = text.split(":/", 1)
                path = "/" + rest
        if not os.path.isabs(path):
            raise ValueError(
                f"capture directory {spec!r} is not an absolute path; give /abs/path or NODE:/abs/path"
            )
        if node is not None and not str(node).strip():
            raise ValueError(f"capture directory {spec!r} has an empty node part; give NODE:/abs/path")
        return cls(os.path.normpath(path), str(node).strip() if node is not None else None)


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _matches(node: dict, matcher: str) -> bool:
    if matcher in (node["NodeID"], node.get("NodeManagerAddress"), node.get("NodeManagerHostname")):
        return True
    if "=" in matcher:
        key, value = matcher.split("=", 1)
        return (node.get("Labels") or {}).get(key) == value
    return False


def _describe(nodes: list[dict]) -> str:
    return ", ".join(
        f"{n['NodeID'][:12]}.. ({n.get('NodeManagerAddress')}, labels {n.get('Labels') or {}})" for n in nodes
    )


@ray.remote(num_cpus=0, max_retries=0)
def _probe(path: str) -> bool:
    return os.path.isdir(path)


def _probe_all(work: list[tuple[str, list[dict]]]) -> list[tuple[list[dict], list[dict]]]:
    """For each (path, candidate nodes): the nodes that hold the directory and the nodes
    that did not answer in time. All probes run at once, so many directories cost one
    round trip, not one each."""
    refs = [
        [
            _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(path)
            for n in nodes
        ]
        for path, nodes in work
    ]
    flat = [ref for row in refs for ref in row]
    ready, _ = ray.wait(flat, num_returns=len(flat), timeout=PROBE_TIMEOUT_S)
    ready_set = set(ready)
    out = []
    for (_, nodes), row in zip(work, refs):
        found, silent = [], []
        for node, ref in zip(nodes, row):
            if ref not in ready_set:
                silent.append(node)
                ray.cancel(ref, force=True)
                continue
            try:
                if ray.get(ref):
                    found.append(node)
            except ray.exceptions.RayError:
                continue  # a node dying mid-probe cannot serve the directory anyway
        out.append((found, silent))
    return out


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
    work: list[tuple[str, list[dict]]] = []
    for d in parsed:
        candidates = nodes
        if d.node is not None:
            candidates = [n for n in nodes if _matches(n, d.node)]
            if not candidates:
                raise ValueError(
                    f"capture directory {d.label}: node {d.node!r} matches no alive Ray node "
                    f"(alive: {_describe(nodes)}); use a node id, IP, hostname or key=value label"
                )
        work.append((d.path, candidates))
    placed: list[tuple[CaptureDir, str]] = []
    served: dict[tuple[str, str], str] = {}
    for d, (_, candidates), (holders, silent) in zip(parsed, work, _probe_all(work)):
        if not holders:
            where = f"node {d.node!r}" if d.node else f"any of the {len(candidates)} alive Ray nodes"
            unanswered = (
                f" ({len(silent)} node(s) did not answer the probe within {PROBE_TIMEOUT_S:.0f} s: "
                f"{_describe(silent)})"
                if silent
                else ""
            )
            raise ValueError(
                f"capture directory {d.path} does not exist on {where}{unanswered}; check the path, "
                "or give NODE:PATH for a directory that lives on a specific node"
            )
        chosen = next((n for n in holders if n["NodeID"] == here), holders[0])["NodeID"]
        other = served.get((chosen, d.path))
        if other is not None:
            raise ValueError(
                f"capture directories {other} and {d.label} are the same directory on node "
                f"{chosen[:12]}..; list it once, or its rollouts would be built twice"
            )
        served[(chosen, d.path)] = d.label
        placed.append((d, chosen))
    return placed
