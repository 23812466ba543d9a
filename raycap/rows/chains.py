"""Chain delivery: every safe trajectory of a rollout, one row each.

Each chain of the builder is its own trajectory, masked chain by chain, failing closed:

- a rollout that cannot be built at all gives exactly one masked row with the reason;
- quarantined calls never appear;
- a chain holding a call of an unresolved retry group is masked;
- an incomplete capture masks every chain of the rollout;
- a chain whose projection fails is masked with the error, the others unaffected;
- several roots or chains are no reason to mask: that is what chain delivery is for.

`weight` is 1 / (unmasked chains of the rollout) on unmasked rows, 0 on masked ones.
`generated_tokens_delivered` counts the generated tokens of the distinct calls in some
unmasked chain, and `delivered_fraction` is their share of those captured. The reasons'
names are `raycap.capture.maskreasons`'.

Why each rule: docs/internals.md ("Chain delivery").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from raycap.capture.builder import BuildOutput, Projection, checked_usage, project_chain
from raycap.capture.consumer import (
    CAUGHT,
    NO_RECORDS,
    Metrics,
    RolloutBuild,
    SnapshotRef,
    error_text,
    failed_build,
    from_frozen,
    run_validated,
)
from raycap.capture.maskreasons import CAPTURE_INCOMPLETE, UNRESOLVED_RETRIES
from raycap.capture.records import CallArrays, TokenEntry
from raycap.capture.store import FrozenCapture

logger = logging.getLogger(__name__)

NO_SAFE_CHAIN = "ValueError: capture produced no safe trainable chain"


@dataclass
class ChainRow:
    """One delivered chain: its trajectory, or the reason it is masked."""

    chain_id: str
    chain_index: int
    is_main: bool
    call_ids: list[str]
    generated_tokens: dict[str, int]
    projection: Projection | None = None
    usage: dict | None = None
    error: str | None = None
    reasons: list[str] = field(default_factory=list)
    weight: float = 0.0

    @property
    def masked(self) -> bool:
        return bool(self.reasons)


@dataclass
class ChainsBuild:
    """A rollout in chain delivery: rollout-level identity and verdict, and its rows."""

    rollout: RolloutBuild
    rows: list[ChainRow]
    rollout_mask_sample: bool  # what single-response delivery would have said


def _rollout_verdict(build: BuildOutput, incomplete: bool) -> bool:
    notes = build.notes
    if not notes.merged:
        return True  # single-response delivery refuses per_request
    return incomplete or bool(notes.unresolved_retries) or notes.roots != 1 or notes.chains != 1


def failed_chains(rollout_id: str, builder: str, model: str, error: str) -> ChainsBuild:
    """A rollout that failed before any chain was built: no rows, masked."""
    return ChainsBuild(failed_build(rollout_id, builder, model, error), [], True)


def assemble_chains(
    rollout_id: str,
    entries: Sequence[TokenEntry],
    builder: str,
    model: str,
    arrays: Sequence[CallArrays] | None = None,
    *,
    incomplete: bool = False,
    snapshots: tuple[SnapshotRef, ...] = (),
) -> ChainsBuild:
    n_calls = len(entries)

    def failed(error: str) -> ChainsBuild:
        rollout = RolloutBuild(
            rollout_id, builder, model, Metrics(n_calls=n_calls), error=error, snapshots=snapshots, incomplete=incomplete
        )
        return ChainsBuild(rollout, [], True)

    if not entries:
        return failed(NO_RECORDS)
    try:
        build = run_validated(builder, entries, arrays)
    except CAUGHT as exc:
        logger.warning("rollout %s: build with %s failed, masking it: %s", rollout_id, builder, error_text(exc))
        return failed(error_text(exc))
    if not build.chains:
        return failed(NO_SAFE_CHAIN)

    unresolved = set(build.notes.unresolved_retries)
    rows: list[ChainRow] = []
    for index, chain in enumerate(build.chains):
        ids = [link.entry.model_call_id for link in chain.links]
        row = ChainRow(
            chain.chain_id,
            index,
            chain.chain_id == "main",
            ids,
            {link.entry.model_call_id: len(link.entry.generation_token_ids) for link in chain.links},
        )
        try:
            row.projection = project_chain(chain)
            row.usage = checked_usage(row.projection)
        except CAUGHT as exc:
            row.projection, row.usage, row.error = None, None, error_text(exc)
            row.reasons.append(type(exc).__name__)
            logger.warning("rollout %s: chain %s masked: %s", rollout_id, chain.chain_id, row.error)
        if unresolved.intersection(ids):
            row.reasons.append(UNRESOLVED_RETRIES)
        if incomplete:
            row.reasons.append(CAPTURE_INCOMPLETE)
        rows.append(row)

    live = [row for row in rows if not row.masked]
    for row in live:
        row.weight = 1.0 / len(live)
    delivered_calls: dict[str, int] = {}
    for row in live:
        delivered_calls.update(row.generated_tokens)
    captured = sum(len(e.generation_token_ids) for e in entries)
    delivered = sum(delivered_calls.values())
    notes = build.notes
    quarantined = len(build.quarantined)
    metrics = Metrics(
        n_calls=n_calls,
        chains=notes.chains,
        # per_request does not count roots: its default 0 is no measurement.
        roots=notes.roots if notes.merged else None,
        quarantined_calls=quarantined,
        quarantined_fraction=round(quarantined / n_calls, 4),
        delivered_fraction=round(delivered / captured, 4) if captured else 0.0,
        generated_tokens_captured=captured,
        generated_tokens_delivered=delivered,
        empty_generation_calls=sum(1 for e in entries if not e.generation_token_ids),
    )
    rollout = RolloutBuild(
        rollout_id,
        builder,
        model,
        metrics,
        unresolved_retries=list(notes.unresolved_retries),
        build=build,
        snapshots=snapshots,
        incomplete=incomplete,
    )
    return ChainsBuild(rollout, rows, _rollout_verdict(build, incomplete))


def build_frozen_chains(
    rollout_id: str,
    parts: Sequence[tuple[str, FrozenCapture]],
    *,
    builder: str = "prefix_merging",
    model: str = "",
) -> ChainsBuild:
    """Chain delivery from raw frozen parts (capture_dir, FrozenCapture)."""
    return from_frozen(rollout_id, parts, builder, model, failed_chains, assemble_chains)
