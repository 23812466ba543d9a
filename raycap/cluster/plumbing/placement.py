"""Where capture directories live: matching them to Ray nodes before any actor starts.

- A directory is local to the node whose model servers wrote it, so its actor must run
  there. A plain absolute path is located by probing every alive node; `NODE:PATH`
  matches NODE against node ids, IP addresses or hostnames, and `key=value` labels.
- A path found on several nodes is placed by evidence: each holder writes a uniquely
  named marker, reports which markers it sees, and removes its own. Nodes that see
  each other's markers share one directory, served once; the others are served apart,
  labelled `<node id>:<path>`. Where no marker can be written, the holders are taken to
  share one directory, with a warning.
- A call costs at most four round trips, however many directories and nodes.
- Placement fails up front (ValueError naming the directory) when no candidate node
  holds it, and when two specs resolve to one directory: its rollouts would count twice.

Test seam: a simulated node labelled ROOT_LABEL sees every absolute path under its own
root (`local_path`), so every path raycap opens on a node goes through `local_path`.
The rules in full: docs/internals.md ("Placement").
"""

from __future__ import annotations

import enum
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.capture.directory import CaptureDir

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0
MARKER_PREFIX = ".raycap-probe-"
ROOT_LABEL = "raycap.test/root"

_root_of_node: dict[str, str] = {}


def local_path(path: str) -> str:
    """`path` as code running on this process's node must open it.

    `<root>/<path without its leading />` on a node labelled `ROOT_LABEL=<root>` (the
    test seam, see the module docstring), else `path` unchanged; a relative path, or a
    process not connected to Ray, always gets `path` back. Map a path once, where it is
    opened: mapping the result again would nest the root twice. The label is read once
    per process and node, so a call costs microseconds.
    """
    path = os.fspath(path)
    if not os.path.isabs(path) or not ray.is_initialized():
        return path
    context = ray.get_runtime_context()
    node = context.get_node_id()
    root = _root_of_node.get(node)
    if root is None:
        # A dict of str -> str in this Ray (the annotation says lists of values).
        root = _root_of_node[node] = str((context.get_node_labels() or {}).get(ROOT_LABEL) or "")
    return os.path.join(root, path.lstrip("/")) if root else path


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


# How often work that waits on a node checks that the node is still alive: a restart
# pinned to a dead node can never be scheduled, so waiting on it is pointless.
LIVENESS_CHECK_S = 0.5


def dead_nodes(nodes: set[str]) -> set[str]:
    """The nodes of `nodes` that are not alive (one query of the cluster's node table)."""
    if not nodes:
        return set()
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return {node for node in nodes if node not in alive}


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
    return os.path.isdir(local_path(path))


@ray.remote(num_cpus=0, max_retries=0)
def _write_marker(path: str, name: str) -> str | None:
    """None once the marker exists, else why it could not be written."""
    try:
        os.close(os.open(os.path.join(local_path(path), name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@ray.remote(num_cpus=0, max_retries=0)
def _seen_markers(path: str, names: list[str]) -> list[bool]:
    directory = local_path(path)
    return [os.path.lexists(os.path.join(directory, name)) for name in names]


@ray.remote(num_cpus=0, max_retries=0)
def _remove_markers(path: str, names: list[str]) -> None:
    directory = local_path(path)
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass  # best effort: a leftover marker is an ignored dot file, not a rollout


class _NoAnswer(enum.Enum):
    SILENT = "did not answer in time"
    FAILED = "failed (its node or worker died)"


def _ask(calls: list[tuple[str, Any, tuple]]) -> list[Any]:
    """Run each (node id, remote function, args) pinned to its node, all at once, and
    return each call's value, or a _NoAnswer when it did not answer within
    PROBE_TIMEOUT_S (it is then cancelled) or failed."""
    refs = [
        fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
        for node, fn, args in calls
    ]
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    ready_set = set(ready)
    out: list[Any] = []
    for ref in refs:
        if ref not in ready_set:
            ray.cancel(ref, force=True)
            out.append(_NoAnswer.SILENT)
            continue
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayError:
            out.append(_NoAnswer.FAILED)  # a node dying mid-probe cannot serve the directory anyway
    return out


def _probe_all(work: list[tuple[str, list[dict]]]) -> list[tuple[list[dict], list[dict]]]:
    """For each (path, candidate nodes): the nodes that hold the directory and the nodes
    that did not answer in time. All probes run at once, so many directories cost one
    round trip, not one each."""
    # The driver's own node is answered here, in-process: a single-node cluster (an
    # embedded Ray) places its directories without starting a task.
    here = ray.get_runtime_context().get_node_id()
    remote = _ask([(n["NodeID"], _probe, (path,)) for path, nodes in work for n in nodes if n["NodeID"] != here])
    remote_answers = iter(remote)
    answers = iter(
        [
            os.path.isdir(local_path(path)) if n["NodeID"] == here else next(remote_answers)
            for path, nodes in work
            for n in nodes
        ]
    )
    out = []
    for _, nodes in work:
        found, silent = [], []
        for node in nodes:
            answer = next(answers)
            if answer is _NoAnswer.SILENT:
                silent.append(node)
            elif answer is True:
                found.append(node)
        out.append((found, silent))
    return out


@dataclass(frozen=True)
class _Sharing:
    """How the holders of one path (indices into its holder list) share it."""

    groups: list[list[int]]  # by evidence: each group sees one directory
    unresolved: list[int]  # answered, but no marker could tell: wrote none, saw none
    unanswered: list[int]  # did not answer the marker check


def _partition(wrote: list[bool], seen: list[list[bool] | None]) -> _Sharing:
    """Split holders 0..n-1 by the markers they see: `wrote[i]` says holder i wrote its
    marker, `seen[j][i]` whether holder j sees marker i (`seen[j]` is None when j did not
    answer). Seeing another's marker means sharing its directory; sharing is transitive."""
    count = len(wrote)
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    evidence = [False] * count
    for j, row in enumerate(seen):
        for i, sees in enumerate(row or ()):
            if sees and wrote[i]:
                evidence[i] = evidence[j] = True
                parent[root(j)] = root(i)
    members: dict[int, list[int]] = {}
    for i in range(count):
        if evidence[i]:
            members.setdefault(root(i), []).append(i)
    groups = sorted(members.values(), key=lambda group: group[0])
    unresolved = [i for i in range(count) if not evidence[i] and seen[i] is not None]
    unanswered = [i for i in range(count) if not evidence[i] and seen[i] is None]
    return _Sharing(groups, unresolved, unanswered)


def _share_groups(work: list[tuple[str, list[dict]]]) -> list[list[tuple[list[dict], bool]]]:
    """For each (path, holders) with several holders: the groups of holders that share
    one directory, each with whether the marker check proved it (False for the holders
    taken to share for lack of evidence). Every step runs for all paths at once."""
    names = [[f"{MARKER_PREFIX}{uuid.uuid4().hex}" for _ in holders] for _, holders in work]
    write_of = iter(
        _ask(
            [
                (n["NodeID"], _write_marker, (path, name))
                for (path, holders), row in zip(work, names)
                for n, name in zip(holders, row)
            ]
        )
    )
    answers = [[next(write_of) for _ in holders] for _, holders in work]
    wrote = [[answer is None for answer in row] for row in answers]
    # A node that did not answer the write is not asked again: it would only keep
    # every later step waiting for the deadline.
    asked = [[not isinstance(answer, _NoAnswer) for answer in row] for row in answers]
    checks = [
        (n["NodeID"], _seen_markers, (path, row_names))
        for (path, holders), row_names, row_asked in zip(work, names, asked)
        for n, ok in zip(holders, row_asked)
        if ok
    ]
    seen: list[list[list[bool] | None]] = []
    try:
        check_of = iter(_ask(checks))
        for _entry, row_asked in zip(work, asked):
            row: list[list[bool] | None] = []
            for ok in row_asked:
                answer = next(check_of) if ok else None
                row.append(None if isinstance(answer, _NoAnswer) else answer)
            seen.append(row)
    finally:
        _remove_all(work, names, wrote, seen)
    out = []
    for (path, holders), row_answers, row_wrote, row_seen in zip(work, answers, wrote, seen):
        sharing = _partition(row_wrote, row_seen)
        groups = [([holders[i] for i in group], True) for group in sharing.groups]
        if sharing.unresolved:
            unresolved = [holders[i] for i in sharing.unresolved]
            why = sorted({a for i, a in enumerate(row_answers) if i in sharing.unresolved and isinstance(a, str)})
            logger.warning(
                "capture directory %s: no marker could be written there through %s (%s), so whether "
                "they hold one shared directory or one each cannot be checked; serving it once, as "
                "shared storage. If these nodes hold different directories, give each as NODE:PATH",
                path,
                _describe(unresolved),
                "; ".join(why) or "no marker seen",
            )
            groups.append((unresolved, False))
        if sharing.unanswered:
            logger.warning(
                "capture directory %s: %d node(s) did not answer the marker check within %.0f s: %s; "
                "what they hold under this path is not served",
                path,
                len(sharing.unanswered),
                PROBE_TIMEOUT_S,
                _describe([holders[i] for i in sharing.unanswered]),
            )
        out.append(groups)
    return out


def _remove_all(
    work: list[tuple[str, list[dict]]],
    names: list[list[str]],
    wrote: list[list[bool]],
    seen: list[list[list[bool] | None]],
) -> None:
    """Remove every written marker, best effort: through the node that wrote it, or, when
    that node did not answer the check, through a node that saw it."""
    by_node: dict[tuple[int, str], list[str]] = {}
    for k, ((_path, holders), row_names, row_wrote) in enumerate(zip(work, names, wrote)):
        row_seen = seen[k] if k < len(seen) else None  # None: the check was interrupted
        for i, name in enumerate(row_names):
            if not row_wrote[i]:
                continue
            remover: int | None = i
            if row_seen is not None and row_seen[i] is None:
                remover = next((j for j, row in enumerate(row_seen) if row is not None and row[i]), None)
            if remover is not None:
                by_node.setdefault((k, holders[remover]["NodeID"]), []).append(name)
    _ask([(node, _remove_markers, (work[k][0], marker_names)) for (k, node), marker_names in by_node.items()])


def locate(dirs: Iterable[Any]) -> list[tuple[CaptureDir, str]]:
    """Parse directory specs and return each directory with the id of the node that will
    serve it: one entry per spec, or one per group of nodes holding distinct directories
    under a spec's path (see the module docstring)."""
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
    found = _probe_all(work)
    for d, (_, candidates), (holders, silent) in zip(parsed, work, found):
        unanswered = (
            f"{len(silent)} node(s) did not answer the probe within {PROBE_TIMEOUT_S:.0f} s: {_describe(silent)}"
            if silent
            else ""
        )
        if not holders:
            where = f"node {d.node!r}" if d.node else f"any of the {len(candidates)} alive Ray nodes"
            raise ValueError(
                f"capture directory {d.path} does not exist on {where}"
                f"{f' ({unanswered})' if unanswered else ''}; check the path, "
                "or give NODE:PATH for a directory that lives on a specific node"
            )
        if unanswered:
            logger.warning(
                "capture directory %s: %s; what they hold under this path is not served", d.label, unanswered
            )
    shared = [k for k, (holders, _) in enumerate(found) if len(holders) > 1]
    groups_of: dict[int, list[tuple[list[dict], bool]]] = {
        k: [([holders[0]], True)] for k, (holders, _) in enumerate(found)
    }
    groups_of.update(zip(shared, _share_groups([(parsed[k].path, found[k][0]) for k in shared])))
    placed: list[tuple[CaptureDir, str]] = []
    served: dict[tuple[str, str], str] = {}
    for k, d in enumerate(parsed):
        groups = groups_of[k]
        for members, proven in groups:
            chosen = next((n for n in members if n["NodeID"] == here), members[0])["NodeID"]
            entry = d if len(groups) == 1 else CaptureDir(d.path, chosen)
            # Every node proven to share the directory sees the same rollouts: another
            # spec served from any of them would build them twice.
            sharers = [n["NodeID"] for n in members] if proven else [chosen]
            clash = next((node for node in sharers if (node, d.path) in served), None)
            if clash is not None:
                raise ValueError(
                    f"capture directories {served[(clash, d.path)]} and {entry.label} are the same "
                    f"directory on node {clash[:12]}..; list it once, or its rollouts would be built twice"
                )
            served.update(((node, d.path), entry.label) for node in sharers)
            placed.append((entry, chosen))
    return placed
