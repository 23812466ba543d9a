"""Chain delivery: one row per chain, masked chain by chain (raycap.rows.chains)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from raycap.capture.builder import projection_items
from raycap.capture.consumer import assemble
from raycap.capture.records import TokenEntry
from raycap.rows.arrow import CHAIN_SCHEMA, builds_from_table, chains_to_table
from raycap.rows.chains import assemble_chains
from reference import reference_project_chain, reference_run_builder
from strategies import examples, rollouts

SETTINGS = settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def call(call_id, prompt, gen, created_at=0.0):
    return TokenEntry(
        rollout_id="r",
        model_call_id=call_id,
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=[-0.25 * (i + 1) for i in range(len(gen))],
        created_at=created_at,
    )


# A main conversation a -> b -> c, and a sub-agent branch s off a.
MAIN = [call("a", [1, 2], [3, 4]), call("b", [1, 2, 3, 4, 5], [6]), call("c", [1, 2, 3, 4, 5, 6, 7], [8, 9])]
BRANCH = [call("s", [1, 2, 3, 4, 50], [51, 52], created_at=1.0)]


def rows_by_id(result):
    return {row.chain_id: row for row in result.rows}


def test_branch_gives_two_unmasked_rows_with_equal_weight():
    result = assemble_chains("r", MAIN + BRANCH, "prefix_merging", "")
    rows = rows_by_id(result)
    assert set(rows) == {"main", "branch-0"}
    assert [rows[c].masked for c in rows] == [False, False]
    assert rows["main"].weight == rows["branch-0"].weight == 0.5
    assert result.rollout_mask_sample is True  # single-response delivery masks this rollout
    # a's tokens are shared by both chains but count once in the delivered share.
    assert result.rollout.metrics.generated_tokens_delivered == 2 + 1 + 2 + 2
    assert result.rollout.metrics.delivered_fraction == 1.0


def test_compaction_and_side_call_chains_are_delivered():
    compacted = [call("d", [90, 91], [92], created_at=5.0), call("e", [90, 91, 92, 93], [94], created_at=6.0)]
    side = [call("x", [1, 2, 3], [70], created_at=0.5)]  # a one-off call on a prefix of the history
    result = assemble_chains("r", MAIN + compacted + side, "prefix_merging", "")
    assert result.rollout.metrics.roots == 3
    assert len(result.rows) == 3
    assert not any(row.masked for row in result.rows)
    assert sorted(round(row.weight, 4) for row in result.rows) == [0.3333] * 3


def test_unresolved_retry_masks_only_the_branch_that_contains_it():
    retries = [call("s", [1, 2, 3, 4, 50], [51], created_at=1.0), call("t", [1, 2, 3, 4, 50], [61], created_at=1.0)]
    result = assemble_chains("r", MAIN + retries, "prefix_merging", "")
    assert result.rollout.unresolved_retries == ["s", "t"]
    conversation = [row for row in result.rows if "c" in row.call_ids]
    assert len(conversation) == 1 and conversation[0].masked is False and conversation[0].weight == 1.0
    branch = [row for row in result.rows if "s" in row.call_ids]
    assert len(branch) == 1 and branch[0].reasons == ["unresolved_retries"] and branch[0].weight == 0.0
    assert all("t" not in row.call_ids for row in result.rows)  # quarantined calls never appear


def test_incomplete_capture_masks_every_chain():
    result = assemble_chains("r", MAIN + BRANCH, "prefix_merging", "", incomplete=True)
    assert [row.reasons for row in result.rows] == [["capture_incomplete"]] * 2
    assert all(row.weight == 0.0 for row in result.rows)
    assert result.rollout.metrics.generated_tokens_delivered == 0


def test_per_request_is_one_row_per_call():
    result = assemble_chains("r", MAIN + [call("z", [5], [])], "per_request", "")
    assert [row.chain_id for row in result.rows] == ["req-0", "req-1", "req-2", "req-3"]
    empty = next(row for row in result.rows if row.call_ids == ["z"])
    assert empty.error == "ValueError: capture produced no trainable generated tokens"
    assert all(row.weight == pytest.approx(1 / 3) for row in result.rows if row is not empty)


def test_rollout_without_a_safe_chain_gives_exactly_one_masked_row():
    twins = [call("a", [1], [2]), call("b", [1], [2]), call("c", [1, 2, 3], [4])]  # c's parent is ambiguous
    result = assemble_chains("r", twins, "prefix_merging", "")
    table = chains_to_table([result])
    assert table.num_rows == 1
    row = table.to_pylist()[0]
    assert row["mask_sample"] is True and row["chain_id"] is None and row["weight"] == 0.0
    assert row["error"] == "ValueError: capture produced no safe trainable chain"


def test_single_chain_rollout_row_equals_rollout_delivery():
    chains = chains_to_table([assemble_chains("r", MAIN, "prefix_merging", "m")])
    assert chains.schema == CHAIN_SCHEMA
    (build,) = builds_from_table(chains)
    assert build.pop("_chain")["is_main"] is True
    assert build == assemble("r", MAIN, "prefix_merging", "m").to_build()


@pytest.mark.slow
@SETTINGS
@given(rollouts())
def test_every_chain_matches_the_reference_projection_and_counts_tokens_once(entries):
    result = assemble_chains("r", entries, "prefix_merging", "")
    if result.rollout.error is not None:
        assert result.rows == []
        return
    reference = reference_run_builder("prefix_merging", entries)
    assert [row.chain_id for row in result.rows] == [c.chain_id for c in reference.chains]
    live = [row for row in result.rows if not row.masked]
    if live:
        assert sum(row.weight for row in live) == pytest.approx(1.0)
    for row, chain in zip(result.rows, reference.chains):
        if row.projection is None:
            continue
        assert projection_items(row.projection) == reference_project_chain(chain)
        # Every generated token of the chain is trained on exactly once.
        mask = row.projection.loss_mask
        assert int(mask.sum()) == sum(row.generated_tokens.values())
        covered = np.zeros(len(mask), dtype=int)
        for c in row.projection.calls:
            covered[c.gen_start : c.gen_end] += 1
        assert np.array_equal(covered, mask)
