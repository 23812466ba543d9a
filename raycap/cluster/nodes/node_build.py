"""Builds that node actors start on their own nodes: the node side of a step over many nodes.

A step whose directories span nodes is one call from the driver to its own node's
actor, the step's gatherer (`gather_step`), which sends each node's actor one call with
the step's ids (`build_held`), so the driver's CPU does not grow with the cluster. Each
node's actor finds which of its directories hold each id, submits the builder tasks
(`raycap.cluster.plumbing.task`) for those, preferring its node, and answers once.

The gatherer puts the rows of ids held on exactly one node in the ids' order, as one
table, and names the ids it could not place (on no node, or on several) and whether a
node was lost: the driver builds those as before. Batches are sized as on one node
(`batch_parts`, at most MAX_BATCH_ROLLOUTS). `describe_build` is a node's build for a
stream, whose rows stay in the object store (`raycap.stream.steps.describe`).

The long form: docs/internals.md ("Builds on the nodes").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycap.capture.store import TokenCaptureStore, is_valid_rollout_id
from raycap.cluster.plumbing import task as _task
from raycap.cluster.plumbing.task import Source
from raycap.rows.batch import IpcTable, schema_of
from raycap.rows.options import RebuildOptions
from raycap.stream.steps import conform, describe

MAX_BATCH_ROLLOUTS = 64
MIN_PER_TASK = 32


def batch_parts(ids: Sequence[Any], cpus: int, batch_size: int | None) -> list[list[Any]]:
    """`ids` cut into consecutive builder batches (see the module docstring)."""
    n = len(ids)
    if not n:
        return []
    if batch_size is not None:
        parts = -(-n // batch_size)
    else:
        parts = max(1, min(4 * cpus, n // MIN_PER_TASK))
        parts = max(-(-n // MAX_BATCH_ROLLOUTS), cpus * -(-parts // cpus))
        parts = min(parts, n)
    step = -(-n // parts)
    return [list(ids[start : start + step]) for start in range(0, n, step)]


def held_masks(stores: Sequence[TokenCaptureStore], rollout_ids: Sequence[Any]) -> list[int]:
    """For each id, a bit per store that holds it (an invalid id is held nowhere)."""
    valid = [r for r in rollout_ids if is_valid_rollout_id(r)]
    masks = dict.fromkeys(valid, 0)
    for k, store in enumerate(stores):
        for rid in store.held(valid):
            masks[rid] |= 1 << k
    return [masks.get(r, 0) if isinstance(r, str) else 0 for r in rollout_ids]


def row_counts(table: pa.Table) -> dict[str, int]:
    counts: dict[str, int] = {}
    for rid in table.column("rollout_id").to_pylist():
        counts[rid] = counts.get(rid, 0) + 1
    return counts


def _pinned(node: str) -> Any:
    # Preferred, not required: a node with no free CPU lends the build to another node,
    # which then reads the captures through this node's actor.
    return _task.build_batch_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True))


def _sources_of(masks: Sequence[int], sources: Sequence[Source]) -> list[Source]:
    used = 0
    for mask in masks:
        used |= mask
    return [s for k, s in enumerate(sources) if used >> k & 1]


async def build_held(
    sources: Sequence[Source],
    rollout_ids: list[Any],
    options: RebuildOptions,
    *,
    node: str,
    cpus: int,
    stores: Callable[[], Sequence[TokenCaptureStore]],
    io: Callable[..., Any],
) -> tuple[list[tuple[int, int]], IpcTable]:
    """In the node actor: build the ids that `sources` (this node's directories) hold.
    Returns (directory bits, rows) per id, and the rows of the held ids in their order.
    `io(fn)` runs blocking file work on the actor's pool."""
    masks = await io(lambda: held_masks(stores(), rollout_ids))
    held = [(rid, mask) for rid, mask in zip(rollout_ids, masks) if mask]
    task = _pinned(node)
    refs = []
    for index, part in enumerate(batch_parts(held, cpus, options.batch_size)):
        ids = [rid for rid, _ in part]
        used = _sources_of([mask for _, mask in part], sources)
        refs.append(task.remote(index, ids, used, None, options, None))
    tables = list(await asyncio.gather(*refs)) if refs else []
    table = pa.concat_tables(tables) if tables else schema_of(options.delivery, options.version_key).empty_table()
    counts = row_counts(table)
    return [(mask, counts.get(rid, 0) if mask else 0) for rid, mask in zip(rollout_ids, masks)], IpcTable(table)


def build_and_describe(index: int, rollout_ids: list[str], sources: list[Source], options: RebuildOptions,
                        schema: pa.Schema, version_key: str | None) -> tuple[tuple[IpcTable, list[int]], IpcTable]:
    """A builder task for a stream: the rows, and beside them their metadata and each
    rollout's bytes (`raycap.stream.steps.describe`), as two objects."""
    table = conform(_task.build_one_batch(index, rollout_ids, sources, None, options, None).table, schema, version_key)
    meta, sizes = describe(table, schema, version_key)
    return (IpcTable(meta), sizes), IpcTable(table)


_DESCRIBED: list[Any] = []


def _described_task() -> Any:
    if not _DESCRIBED:
        _DESCRIBED.append(ray.remote(num_cpus=1, max_retries=_task.TASK_MAX_RETRIES, num_returns=2)(build_and_describe))
    return _DESCRIBED[0]


def describe_build(
    sources: Sequence[Source], rollout_ids: list[str], options: RebuildOptions, *, node: str, cpus: int,
    schema: pa.Schema,
) -> list[tuple[list[str], Any, Any]]:
    """In the node actor: start a stream's builds of `rollout_ids` (all held by `sources`,
    this node's directories). Returns per batch its ids, the ref of its metadata
    ((metadata table, bytes per rollout)) and the ref of its rows."""
    task = _described_task().options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True))
    out = []
    for index, ids in enumerate(batch_parts(rollout_ids, cpus, options.batch_size)):
        meta, rows = task.remote(index, ids, list(sources), options, schema, options.version_key)
        out.append((ids, meta, rows))
    return out


@dataclass(frozen=True)
class StepAnswer:
    """The gatherer's answer besides the rows: the ids it could not place on one node,
    each as (position among the ids, the step's directories that hold it), and the
    nodes lost before they answered (then nothing else is known)."""

    left: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    error: str = ""


def rows_in_order(plan: Sequence[tuple[int, Any]], tables: Sequence[pa.Table], schema: pa.Schema,
                  version_key: str | None) -> pa.Table:
    """The rows of each (table, rollout id) of `plan`, in its order (a rollout's rows,
    several in chain delivery, in their order in its table)."""
    tables = [conform(table, schema, version_key) for table in tables]
    where: list[dict[Any, list[int]]] = []
    for table in tables:
        rows: dict[Any, list[int]] = {}
        for row, rid in enumerate(table.column("rollout_id").to_pylist()):
            rows.setdefault(rid, []).append(row)
        where.append(rows)
    pieces: list[pa.Table] = []
    current, taken = -1, []
    for k, rid in plan:
        if k != current and taken:
            pieces.append(tables[current].take(pa.array(taken, pa.int64())))
            taken = []
        current = k
        taken.extend(where[k].get(rid, ()))
    if taken:
        pieces.append(tables[current].take(pa.array(taken, pa.int64())))
    return pa.concat_tables(pieces) if pieces else schema.empty_table()


async def gather_step(
    nodes: list[tuple[str, Any, list[int], list[tuple[str, str]]]],
    rollout_ids: list[Any],
    options: RebuildOptions,
    *,
    dead: Callable[[set[str]], Any],
    io: Callable[..., Any],
    wait_s: float,
) -> tuple[StepAnswer, IpcTable]:
    """In the gatherer (the driver's node's actor): `nodes` lists each node's id, actor,
    the step's directory indices it serves and their (label, path). See the module
    docstring. `dead(nodes)` (awaitable) names the nodes of a set that are gone; it is
    asked every `wait_s` while an answer is awaited."""
    schema = schema_of(options.delivery, options.version_key)
    step = (rollout_ids, options)
    calls = [actor.build_held.options(num_returns=2).remote(spec, step) for _, actor, _, spec in nodes]
    infos: list[Any] = [info for info, _ in calls]
    pending = {asyncio.ensure_future(_awaited(ref)) for ref in infos}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=wait_s)
        if pending:
            gone = await dead({node for node, *_ in nodes})
            if gone:
                for future in pending:
                    future.cancel()
                return StepAnswer(lost=sorted(gone)), IpcTable(schema.empty_table())
    answers = await asyncio.gather(*infos, return_exceptions=True)
    failed = [(node, a) for (node, *_), a in zip(nodes, answers) if isinstance(a, BaseException)]
    if failed:
        error = f"{type(failed[0][1]).__name__}: {failed[0][1]}"
        return StepAnswer(lost=[node for node, _ in failed], error=error), IpcTable(schema.empty_table())
    holders: list[list[int]] = [[] for _ in rollout_ids]
    for k, answer in enumerate(answers):
        for i, (mask, _) in enumerate(answer):
            if mask:
                holders[i].append(k)
    plan, left = [], []
    for i, (rid, held) in enumerate(zip(rollout_ids, holders)):
        if len(held) == 1:
            plan.append((held[0], rid))
        else:
            where = [d for k in held for bit, d in enumerate(nodes[k][2]) if answers[k][i][0] >> bit & 1]
            left.append((i, tuple(sorted(where))))
    used = sorted({k for k, _ in plan})
    fetched = dict(zip(used, await asyncio.gather(*(calls[k][1] for k in used))))
    index = {k: j for j, k in enumerate(used)}
    rows = await io(lambda: rows_in_order([(index[k], rid) for k, rid in plan], [fetched[k] for k in used], schema,
                                          options.version_key))
    return StepAnswer(left=left), IpcTable(rows)


async def _awaited(ref: Any) -> None:
    try:
        await ref
    except Exception:  # noqa: BLE001 - judged when every answer is in
        pass
