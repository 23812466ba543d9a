"""Object refs of a step whose directories span nodes: the driver's part is one call.

The driver sends the step to its own node's actor, the step's gatherer, which has every
node's actor build the ids it holds on its node and puts their rows in the order of the
ids (the node side: `raycap.cluster.nodes.node_build`). So the driver's cost for a step is one
actor call and one object, whatever the number of nodes, rollouts or batches: no
freezes come back to it, it submits no builder task, and it keeps no object per node.

Then:

- the rows of the ids held on exactly one node are one table, in the order of the ids;
- an id held on none (frozen in the first directory, like the single-rollout API, so
  its row says so) or on several nodes (assembled across them) is built as before, by
  `raycap.cluster.rebuild.scheduler` (rare, both), and one small task puts all the rows in the
  order of the ids (`select_rows`);
- a node that is lost, or whose actor dies, before it answered leaves every id's
  holders unknown: `node_refs` returns None and the caller builds the step as before,
  which masks the rows it cannot reach with an error naming the directory.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa
import ray

from raycap.cluster.nodes.fleet import Fleet, gatherer
from raycap.cluster.nodes.node_build import StepAnswer, rows_in_order
from raycap.cluster.plumbing.failures import cause_text
from raycap.cluster.rebuild.scheduler import BatchScheduler
from raycap.rows.batch import IpcTable, schema_of
from raycap.rows.options import RebuildOptions

logger = logging.getLogger(__name__)


def node_refs(fleet: Fleet, rollout_ids: list[Any], options: RebuildOptions, *, cpus: int) -> list[Any] | None:
    """The ObjectRefs of the rows of `rollout_ids`, in their order, built by the nodes'
    actors (see the module docstring); None when a node or its actor was lost first."""
    by_node: dict[str, list[int]] = {}
    for d, node in enumerate(fleet.nodes):
        by_node.setdefault(node, []).append(d)
    nodes = [(node, dirs, [(fleet.dirs[d].label, fleet.dirs[d].path) for d in dirs]) for node, dirs in by_node.items()]
    try:
        relay = gatherer()
        answer_ref, rows_ref = relay.gather_step.options(num_returns=2).remote(nodes, rollout_ids, options)
        answer: StepAnswer = ray.get(answer_ref)
    except ray.exceptions.RayError as exc:
        gatherer(forget=True)
        logger.warning("building a step on its nodes failed (%s); building it from the driver instead", cause_text(exc))
        return None
    if answer.lost:
        logger.warning(
            "node(s) %s did not answer the step (%s); building it from the driver instead",
            ", ".join(f"{n[:12]}.." for n in answer.lost), answer.error or "gone",
        )
        return None
    if not answer.left:
        return [rows_ref]
    left = [i for i, _ in answer.left]
    scheduler = BatchScheduler(
        fleet, [rollout_ids[i] for i in left], [dirs for _, dirs in answer.left], options,
        cpus=cpus, shard_dir=None, progress=None,
    )
    refs = scheduler.refs()
    source = {rollout_ids[i]: 0 for i in range(len(rollout_ids))}
    for b, batch in enumerate(scheduler.batches):
        for rid in batch.ids:
            source[rid] = 1 + b
    plan = [(source[rid], rid) for rid in rollout_ids]
    schema = schema_of(options.delivery, options.version_key)
    return [_select_task().remote(plan, schema, options.version_key, rows_ref, *refs)]


def select_rows(plan: list[tuple[int, Any]], schema: pa.Schema, version_key: str | None, *tables: pa.Table) -> IpcTable:
    """On Ray: the rows of each (table, rollout id) of `plan`, in its order."""
    return IpcTable(rows_in_order(plan, tables, schema, version_key))


_SELECT: list[Any] = []


def _select_task() -> Any:
    if not _SELECT:
        # No CPU reserved: small, and on the step's path; it must not wait behind builders.
        _SELECT.append(ray.remote(num_cpus=0)(select_rows))
    return _SELECT[0]

