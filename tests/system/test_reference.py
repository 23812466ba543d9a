"""The reference builders, projection and consumer against the spec, rule by rule.

Each unit test is one small rollout whose expected chains and notes are worked out by
hand from the spec text. The property tests check invariants on random rollouts:
capture order does not matter, chains are prefix-consistent and follow the parent rule,
the notes agree with the chains, and a build never raises.
"""

from __future__ import annotations

import sys
import time
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raycap.capture.protocols import TokenCaptureSnapshot
from raycap.capture.records import TokenEntry, entry_line
from raycap.capture.store import FrozenCapture
from reference import (
    PER_REQUEST_UNSUPPORTED,
    BuildOutput,
    Chain,
    ChainLink,
    reference_assemble,
    reference_assert_prefix_contiguity,
    reference_failed_build,
    reference_per_request,
    reference_prefix_merging,
    reference_project_chain,
    reference_project_response,
    reference_run_builder,
    reference_trajectories_for_rollout,
)
from strategies import examples, rollouts

PROPERTY = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def call(call_id, prompt, gen, *, created_at=0.0, items=(), index=None, experts=None, rollout_id="r"):
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        model="policy",
        prompt_token_ids=list(prompt),
        generation_token_ids=list(gen),
        generation_log_probs=[-0.25 * (k + 1) for k in range(len(gen))],
        routed_experts=experts,
        output_items=list(items),
        token_item_index=index,
        created_at=created_at,
    )


def shape(build: BuildOutput) -> list[tuple]:
    """(chain_id, root_prompt, call ids, interstitials) of every chain, in chain order."""
    return [
        (
            chain.chain_id,
            chain.root_prompt,
            [link.entry.model_call_id for link in chain.links],
            [link.interstitial for link in chain.links],
        )
        for chain in build.chains
    ]


def notes(roots, chains, captured, delivered, fraction, unresolved=(), empty=()):
    return {
        "builder": "prefix_merging",
        "roots": roots,
        "chains": chains,
        "generated_tokens_captured": captured,
        "generated_tokens_delivered": delivered,
        "delivered_fraction": fraction,
        "unresolved_retries": list(unresolved),
        "empty_generation_calls": list(empty),
    }


LINEAR = [
    call("c", [1, 2, 3, 4, 5, 6, 7, 8], [9], created_at=2.0),
    call("a", [1, 2], [3, 4]),
    call("b", [1, 2, 3, 4, 5], [6], created_at=1.0),
]


# --- per_request ------------------------------------------------------------------------


def test_per_request_is_one_chain_per_entry_ordered_by_prompt_length_then_id():
    entries = [
        call("d", [1, 2, 3, 4], [5]),
        call("b", [1, 2], [3]),
        call("c", [1], []),
        call("a", [7, 8], [4]),
    ]
    build = reference_per_request(entries)
    assert shape(build) == [
        ("req-0", [1], ["c"], [[]]),
        ("req-1", [7, 8], ["a"], [[]]),
        ("req-2", [1, 2], ["b"], [[]]),
        ("req-3", [1, 2, 3, 4], ["d"], [[]]),
    ]
    assert build.quarantined == []
    assert build.notes == {"builder": "per_request", "chains": 4}


def test_run_builder_dispatches_by_name_and_refuses_unknown_names():
    assert reference_run_builder("per_request", LINEAR).notes["builder"] == "per_request"
    assert reference_run_builder("prefix_merging", LINEAR).notes["builder"] == "prefix_merging"
    with pytest.raises(ValueError, match="per_request, prefix_merging"):
        reference_run_builder("longest_chain", LINEAR)


# --- prefix_merging: parents ------------------------------------------------------------


def test_linear_conversation_is_one_main_chain():
    build = reference_prefix_merging(LINEAR)
    assert shape(build) == [("main", [1, 2], ["a", "b", "c"], [[], [5], [7, 8]])]
    assert build.quarantined == []
    assert build.notes == notes(roots=1, chains=1, captured=4, delivered=4, fraction=1.0)


def test_continuation_without_new_prompt_ids_has_empty_interstitial():
    build = reference_prefix_merging([call("a", [1], [2]), call("b", [1, 2], [3])])
    assert shape(build) == [("main", [1], ["a", "b"], [[], []])]


def test_empty_generation_calls_are_set_aside_in_input_order():
    # z's prompt+generation is a prefix of b's prompt, but z generated nothing, so it is
    # never a parent.
    entries = [
        call("y", [1, 2, 3], []),
        call("a", [1], [2]),
        call("z", [1, 2], []),
        call("b", [1, 2, 5], [6]),
    ]
    build = reference_prefix_merging(entries)
    assert shape(build) == [("main", [1], ["a", "b"], [[], [5]])]
    assert build.notes == notes(roots=1, chains=1, captured=2, delivered=2, fraction=1.0, empty=["y", "z"])


def test_only_empty_generations_give_no_chains():
    build = reference_prefix_merging([call("x", [1], []), call("w", [2], [])])
    assert build.chains == [] and build.quarantined == []
    assert build.notes == notes(roots=0, chains=0, captured=0, delivered=0, fraction=0.0, empty=["x", "w"])
    assert reference_prefix_merging([]).notes == notes(roots=0, chains=0, captured=0, delivered=0, fraction=0.0)


def test_parent_is_the_longest_cumulative_prefix_and_shared_roots_tie_on_chain_order():
    entries = [
        call("a", [1], [2]),
        call("b", [1, 2, 3], [4]),
        call("s", [1, 2, 9], [1]),
        call("c", [1, 2, 3, 4, 5], [6]),
    ]
    build = reference_prefix_merging(entries)
    # a's [1, 2] and b's [1, 2, 3, 4] both prefix c's prompt: b is longer. Both chains
    # start at a, so the first in chain order (leaf s comes first) is main.
    assert shape(build) == [
        ("main", [1], ["a", "s"], [[], [9]]),
        ("branch-0", [1], ["a", "b", "c"], [[], [3], [5]]),
    ]
    assert build.notes == notes(roots=1, chains=2, captured=4, delivered=2, fraction=0.5)


def test_a_prefix_ending_inside_a_generation_is_not_a_parent():
    entries = [call("a", [1, 2], [3, 4], created_at=1.0), call("b", [1, 2, 3], [5], created_at=0.0)]
    build = reference_prefix_merging(entries)
    # a's cumulative [1, 2, 3, 4] is longer than b's prompt: b is a second root, and the
    # earliest root (b) names the main chain although its chain comes second.
    assert shape(build) == [("branch-0", [1, 2], ["a"], [[]]), ("main", [1, 2, 3], ["b"], [[]])]
    assert build.notes == notes(roots=2, chains=2, captured=3, delivered=1, fraction=0.3333)


def test_empty_prompt_root_can_be_extended():
    build = reference_prefix_merging([call("a", [], [1]), call("b", [1, 2], [3]), call("c", [7], [8], created_at=5)])
    assert shape(build) == [("branch-0", [7], ["c"], [[]]), ("main", [], ["a", "b"], [[], [2]])]


def test_ambiguous_parent_quarantines_the_child_and_drops_its_descendants():
    entries = [
        call("p1", [1], [2, 3]),
        call("p2", [1, 2], [3]),
        call("c", [1, 2, 3, 4], [5]),
        call("g", [1, 2, 3, 4, 5, 6], [7]),
    ]
    build = reference_prefix_merging(entries)
    # p1 and p2 both end at [1, 2, 3]: c's parent is p1 (first processed), c is
    # quarantined, and g (a child of c) loses its path.
    assert shape(build) == [("main", [1, 2], ["p2"], [[]])]
    assert build.quarantined == ["c"]
    assert build.notes == notes(roots=2, chains=1, captured=5, delivered=1, fraction=0.2)


def test_identical_calls_are_unresolved_retries_with_ambiguous_children():
    entries = [
        call("r", [1], [2]),
        call("a2", [1, 2, 3], [4]),
        call("a1", [1, 2, 3], [4]),
        call("b", [1, 2, 3, 4, 5], [6]),
    ]
    build = reference_prefix_merging(entries)
    # b is ambiguous (a1 and a2 end identically), so neither retry has a usable child:
    # keep a1, quarantine a2, report both. No path survives.
    assert build.chains == []
    assert build.quarantined == ["a2", "b"]
    assert build.notes == notes(roots=1, chains=0, captured=4, delivered=0, fraction=0.0, unresolved=["a1", "a2"])


# --- prefix_merging: retries ------------------------------------------------------------


def test_retry_with_a_continuation_keeps_the_continued_attempt():
    entries = [
        call("r", [1], [2]),
        call("x1", [1, 2, 3], [4]),
        call("x2", [1, 2, 3], [5]),
        call("n", [1, 2, 3, 5, 6], [7]),
    ]
    build = reference_prefix_merging(entries)
    assert shape(build) == [("main", [1], ["r", "x2", "n"], [[], [3], [6]])]
    assert build.quarantined == ["x1"]
    assert build.notes == notes(roots=1, chains=1, captured=4, delivered=3, fraction=0.75)


def test_unresolved_retry_keeps_the_smallest_id_and_reports_the_whole_set():
    entries = [
        call("r", [1], [2]),
        call("b", [1, 2, 3], [4]),
        call("c", [1, 2, 3], [6]),
        call("a", [1, 2, 3], [5]),
    ]
    build = reference_prefix_merging(entries)
    assert shape(build) == [("main", [1], ["r", "a"], [[], [3]])]
    assert build.quarantined == ["b", "c"]
    assert build.notes == notes(roots=1, chains=1, captured=4, delivered=2, fraction=0.5, unresolved=["a", "b", "c"])


def test_retries_that_both_continue_are_both_kept():
    entries = [
        call("r", [1], [2]),
        call("x1", [1, 2, 3], [4]),
        call("x2", [1, 2, 3], [5]),
        call("n1", [1, 2, 3, 4, 7], [8]),
        call("n2", [1, 2, 3, 5, 7], [9]),
    ]
    build = reference_prefix_merging(entries)
    assert shape(build) == [
        ("main", [1], ["r", "x1", "n1"], [[], [3], [7]]),
        ("branch-0", [1], ["r", "x2", "n2"], [[], [3], [7]]),
    ]
    assert build.quarantined == []
    assert build.notes["unresolved_retries"] == []


def test_first_call_retries_form_the_root_group_and_still_count_as_roots():
    continued = reference_prefix_merging([call("a", [1, 2], [3]), call("b", [1, 2], [4]), call("c", [1, 2, 4, 5], [6])])
    assert shape(continued) == [("main", [1, 2], ["b", "c"], [[], [5]])]
    assert continued.quarantined == ["a"]
    assert continued.notes == notes(roots=2, chains=1, captured=3, delivered=2, fraction=0.6667)

    unresolved = reference_prefix_merging([call("b", [1, 2], [4]), call("a", [1, 2], [3])])
    assert shape(unresolved) == [("main", [1, 2], ["a"], [[]])]
    assert unresolved.quarantined == ["b"]
    assert unresolved.notes["unresolved_retries"] == ["a", "b"]


def test_calls_under_one_parent_with_different_prompts_are_not_retries():
    build = reference_prefix_merging([call("r", [1], [2]), call("a", [1, 2, 3], [4]), call("b", [1, 2, 4], [5])])
    assert build.quarantined == [] and build.notes["unresolved_retries"] == []
    assert shape(build) == [("main", [1], ["r", "a"], [[], [3]]), ("branch-0", [1], ["r", "b"], [[], [4]])]


def test_retry_sets_are_resolved_top_down_and_reported_in_that_order():
    entries = [
        call("r", [1], [2]),
        call("z1", [1, 2, 3], [4]),
        call("z2", [1, 2, 3], [5]),
        call("m", [1, 2, 9, 9], [3]),
        call("a1", [1, 2, 9, 9, 3, 8], [1]),
        call("a2", [1, 2, 9, 9, 3, 8], [2]),
    ]
    build = reference_prefix_merging(entries)
    # The z set is processed before the a set although "a" < "z".
    assert build.notes["unresolved_retries"] == ["z1", "z2", "a1", "a2"]
    assert build.quarantined == ["z2", "a2"]
    assert shape(build) == [
        ("main", [1], ["r", "z1"], [[], [3]]),
        ("branch-0", [1], ["r", "m", "a1"], [[], [9, 9], [8]]),
    ]


def test_a_parent_set_is_judged_on_children_before_their_own_set_is_resolved():
    entries = [
        call("r", [1], [2]),
        call("a1", [1, 2, 3], [4]),
        call("a2", [1, 2, 3], [5]),
        call("b1", [1, 2, 3, 4, 6], [7]),
        call("b2", [1, 2, 3, 4, 6], [8]),
    ]
    build = reference_prefix_merging(entries)
    assert build.quarantined == ["a2", "b2"]
    assert build.notes["unresolved_retries"] == ["b1", "b2"]
    assert shape(build) == [("main", [1], ["r", "a1", "b1"], [[], [3], [6]])]


# --- prefix_merging: chains and the delivered chain -------------------------------------


def test_compaction_starts_a_new_root():
    entries = [
        call("a", [1, 2, 3], [4], created_at=0.0),
        call("b", [1, 2, 3, 4, 5], [6], created_at=1.0),
        call("c", [7, 8], [9], created_at=2.0),
        call("d", [7, 8, 9, 10], [11], created_at=3.0),
    ]
    build = reference_prefix_merging(entries)
    assert shape(build) == [
        ("branch-0", [7, 8], ["c", "d"], [[], [10]]),
        ("main", [1, 2, 3], ["a", "b"], [[], [5]]),
    ]
    assert build.notes == notes(roots=2, chains=2, captured=4, delivered=2, fraction=0.5)


def test_main_root_tie_on_created_at_goes_to_the_smaller_id():
    build = reference_prefix_merging([call("y", [1], [2], created_at=1.0), call("x", [5, 6], [7], created_at=1.0)])
    assert [(chain.chain_id, chain.links[0].entry.model_call_id) for chain in build.chains] == [
        ("branch-0", "y"),
        ("main", "x"),
    ]


def test_side_calls_are_branches():
    entries = [
        call("a", [1, 2], [3]),
        call("b", [1, 2, 3, 4], [5]),
        call("judge", [1, 2, 3, 8], [0]),
        call("c", [1, 2, 3, 4, 5, 6], [7]),
    ]
    build = reference_prefix_merging(entries)
    assert shape(build) == [
        ("main", [1, 2], ["a", "judge"], [[], [8]]),
        ("branch-0", [1, 2], ["a", "b", "c"], [[], [4], [6]]),
    ]


# --- projection -------------------------------------------------------------------------

REASONING = {"type": "reasoning", "summary": []}
TOOL = {"type": "function_call", "name": "search", "arguments": "{}", "call_id": "fc1"}
MESSAGE = {"type": "message", "role": "assistant", "content": []}


def test_projection_restores_token_arrays_on_each_carrier():
    legacy = {"type": "message", "prompt_token_ids": [0], "generation_token_ids": [0], "generation_log_probs": [0.0]}
    entries = [
        call("a", [1, 2], [3, 4]),  # no items
        call("b", [1, 2, 3, 4, 5], [6], items=[REASONING, TOOL, MESSAGE], index=1),
        call("c", [1, 2, 3, 4, 5, 6, 7], [8], items=[REASONING, legacy]),
        call("d", [1, 2, 3, 4, 5, 6, 7, 8], [9], items=[REASONING, MESSAGE], experts=[[1, 2]]),
    ]
    chain = reference_prefix_merging(entries).chains[0]
    items = reference_project_chain(chain)
    assert items == [
        {"type": "message", "prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.25, -0.5]},
        REASONING,
        {**TOOL, "prompt_token_ids": [1, 2, 3, 4, 5], "generation_token_ids": [6], "generation_log_probs": [-0.25]},
        MESSAGE,
        REASONING,
        {"type": "message", "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7], "generation_token_ids": [8], "generation_log_probs": [-0.25]},
        REASONING,
        {
            **MESSAGE,
            "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "generation_token_ids": [9],
            "generation_log_probs": [-0.25],
            "routed_experts": [[1, 2]],
        },
    ]
    assert list(items[-1]) == ["type", "role", "content", "prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts"]
    # The records are untouched: items are copies.
    assert entries[1].output_items == [REASONING, TOOL, MESSAGE]
    assert entries[2].output_items[1]["prompt_token_ids"] == [0]
    reference_assert_prefix_contiguity(items)


def test_an_item_with_null_inline_generation_is_not_a_carrier():
    entry = call("a", [1], [2], items=[{"type": "reasoning", "generation_token_ids": None}, MESSAGE])
    items = reference_project_chain(Chain("main", [ChainLink(entry, [])], [1]))
    assert items[0] == {"type": "reasoning", "generation_token_ids": None}
    assert items[1]["generation_token_ids"] == [2]


def test_every_inline_item_of_an_old_record_is_a_carrier():
    inline = {"type": "message", "generation_token_ids": [0]}
    entry = call("a", [1], [2], items=[inline, REASONING, inline])
    items = reference_project_chain(Chain("main", [ChainLink(entry, [])], [1]))
    assert items[0] == items[2] == {"type": "message", "generation_token_ids": [2], "prompt_token_ids": [1], "generation_log_probs": [-0.25]}
    assert items[0] is not items[2]


def test_project_response_shape_and_usage():
    response = reference_project_response("r7", reference_prefix_merging(LINEAR), "policy-v2")
    assert response == {
        "id": "proj-r7",
        "model": "policy-v2",
        "object": "response",
        "output": reference_project_chain(reference_prefix_merging(LINEAR).chains[0]),
        "usage": {"input_tokens": 2, "output_tokens": 4},
    }


def test_project_response_delivers_the_main_chain():
    entries = [call("a", [1, 2], [3, 4], created_at=1.0), call("b", [1, 2, 3], [5], created_at=0.0)]
    response = reference_project_response("r", reference_prefix_merging(entries), "")
    assert [item["generation_token_ids"] for item in response["output"]] == [[5]]


def test_project_response_errors():
    with pytest.raises(ValueError, match="capture produced no safe trainable chain"):
        reference_project_response("r", BuildOutput([], [], {"builder": "prefix_merging"}), "")
    with pytest.raises(ValueError, match="per_request"):
        reference_project_response("r", reference_per_request(LINEAR), "")
    one_empty = reference_per_request([call("a", [1], [])])
    with pytest.raises(ValueError, match="capture produced no trainable generated tokens"):
        reference_project_response("r", one_empty, "")
    assert reference_project_response("r", reference_per_request([call("a", [1], [2])]), "")["usage"] == {
        "input_tokens": 1,
        "output_tokens": 1,
    }
    # An inline item beside the indexed carrier is token-bearing; without a prompt the
    # usage cannot be computed.
    stray = {"type": "message", "generation_token_ids": [2]}
    with pytest.raises(KeyError, match="prompt_token_ids"):
        reference_project_response("r", reference_prefix_merging([call("a", [1], [2], items=[stray, MESSAGE], index=1)]), "")


def test_prefix_contiguity():
    reference_assert_prefix_contiguity([])
    reference_assert_prefix_contiguity(
        [
            {"prompt_token_ids": [1], "generation_token_ids": [2]},
            {"type": "reasoning"},
            {"prompt_token_ids": [1, 2, 3], "generation_token_ids": []},
            {"prompt_token_ids": [1, 2, 3, 4], "generation_token_ids": [5]},
        ]
    )
    # A missing or null prompt counts as empty: fine first, a break later.
    reference_assert_prefix_contiguity([{"generation_token_ids": [2]}, {"prompt_token_ids": [2], "generation_token_ids": [3]}])
    reference_assert_prefix_contiguity([{"prompt_token_ids": None, "generation_token_ids": [2]}])
    with pytest.raises(AssertionError, match="projection is not prefix-contiguous"):
        reference_assert_prefix_contiguity([{"prompt_token_ids": [1], "generation_token_ids": [2]}, {"generation_token_ids": [3]}])
    with pytest.raises(AssertionError, match="projection is not prefix-contiguous"):
        reference_assert_prefix_contiguity(
            [{"prompt_token_ids": [1], "generation_token_ids": [2]}, {"prompt_token_ids": [1, 3], "generation_token_ids": [4]}]
        )
    # Only the previous item counts, not everything before it.
    reference_assert_prefix_contiguity(
        [
            {"prompt_token_ids": [1, 2], "generation_token_ids": [3]},
            {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [4], "x": 1},
            {"prompt_token_ids": [1, 2, 3, 4], "generation_token_ids": [5]},
        ]
    )


# --- consumer ---------------------------------------------------------------------------


def test_failed_build_shape():
    assert reference_failed_build("r", "prefix_merging", "ValueError: x", 3) == {
        "rollout_id": "r",
        "builder": "prefix_merging",
        "rebuilt_response": None,
        "mask_sample": True,
        "error": "ValueError: x",
        "metrics": {"n_calls": 3},
    }
    assert reference_failed_build("r", "b", "e")["metrics"] == {"n_calls": 0}


def test_assemble_refuses_per_request():
    assert reference_assemble("r", LINEAR, "per_request", "m") == reference_failed_build(
        "r",
        "per_request",
        "per_request returns multiple trajectories and is not supported by single-response delivery",
        3,
    )


def test_assemble_success():
    entries = LINEAR + [call("e", [1, 2, 3], [])]
    build = reference_assemble("r", entries, "prefix_merging", "m")
    assert build == {
        "rollout_id": "r",
        "builder": "prefix_merging",
        "rebuilt_response": reference_project_response("r", reference_prefix_merging(entries), "m"),
        "metrics": {
            "n_calls": 4,
            "chains": 1,
            "roots": 1,
            "quarantined_calls": 0,
            "quarantined_fraction": 0.0,
            "delivered_fraction": 1.0,
            "generated_tokens_captured": 4,
            "generated_tokens_delivered": 4,
            "empty_generation_calls": 1,
        },
        "mask_sample": False,
        "unresolved_retries": [],
    }
    assert list(build) == ["rollout_id", "builder", "rebuilt_response", "metrics", "mask_sample", "unresolved_retries"]


def test_assemble_masks_unresolved_retries_extra_roots_and_extra_chains():
    unresolved = reference_assemble("r", [call("r", [1], [2]), call("a", [1, 2], [3]), call("b", [1, 2], [4])], "prefix_merging", "")
    assert unresolved["mask_sample"] is True
    assert unresolved["unresolved_retries"] == ["a", "b"]
    assert unresolved["metrics"]["quarantined_calls"] == 1
    assert unresolved["metrics"]["quarantined_fraction"] == 0.3333
    assert unresolved["metrics"]["chains"] == 1 and unresolved["metrics"]["roots"] == 1

    first_call_retry = reference_assemble("r", [call("a", [1], [3]), call("b", [1], [4]), call("c", [1, 4, 5], [6])], "prefix_merging", "")
    assert first_call_retry["unresolved_retries"] == []
    assert first_call_retry["metrics"]["roots"] == 2 and first_call_retry["metrics"]["chains"] == 1
    assert first_call_retry["mask_sample"] is True

    branches = reference_assemble("r", [call("a", [1], [2]), call("b", [1, 2, 3], [4]), call("c", [1, 2, 5], [6])], "prefix_merging", "")
    assert branches["metrics"]["roots"] == 1 and branches["metrics"]["chains"] == 2
    assert branches["mask_sample"] is True


def test_assemble_turns_build_errors_into_masked_builds():
    ambiguous = [call("r", [1], [2]), call("a1", [1, 2, 3], [4]), call("a2", [1, 2, 3], [4]), call("b", [1, 2, 3, 4, 5], [6])]
    assert reference_assemble("r", ambiguous, "prefix_merging", "") == reference_failed_build(
        "r", "prefix_merging", "ValueError: capture produced no safe trainable chain", 4
    )
    assert reference_assemble("r", [], "prefix_merging", "")["error"] == "ValueError: capture produced no safe trainable chain"

    unknown = reference_assemble("r", LINEAR, "longest", "")
    assert unknown["error"].startswith("ValueError: unknown builder 'longest'")
    assert unknown["metrics"] == {"n_calls": 3} and unknown["mask_sample"] is True

    stray = {"type": "message", "generation_token_ids": [2]}
    missing_prompt = reference_assemble("r", [call("a", [1], [2], items=[stray, MESSAGE], index=1)], "prefix_merging", "")
    assert missing_prompt["error"] == "KeyError: 'prompt_token_ids'"

    stray = {"type": "message", "prompt_token_ids": [7], "generation_token_ids": [2]}
    broken = reference_assemble("r", [call("a", [1], [2], items=[stray, MESSAGE], index=1)], "prefix_merging", "")
    assert broken["error"] == "AssertionError: projection is not prefix-contiguous"

    bad = TokenEntry.model_construct(
        rollout_id="r", model_call_id="a", prompt_token_ids=[1], generation_token_ids=[2, 3], generation_log_probs=[-1.0],
        output_items=[], token_item_index=None, routed_experts=None, created_at=0.0, model="",
    )
    mismatch = reference_assemble("r", [bad], "prefix_merging", "")
    assert mismatch["error"].startswith("ValueError: ") and "log probs" in mismatch["error"]
    assert mismatch["rebuilt_response"] is None


# --- trajectories_for_rollout -----------------------------------------------------------


class _FakeStore:
    """Stands in for the capture store: freeze_raw returns (the lines of) or raises what the test set."""

    opened: list = []
    outcome: object = None

    def __init__(self, directory):
        _FakeStore.opened.append(directory)

    def freeze_raw(self, rollout_id):
        if isinstance(_FakeStore.outcome, Exception):
            raise _FakeStore.outcome
        snap = _FakeStore.outcome
        data = b"".join(entry_line(e) + b"\n" for e in snap.entries)
        return FrozenCapture(snap.rollout_id, snap.snapshot_id, snap.version, snap.incomplete, data)


@pytest.fixture
def fake_store(monkeypatch):
    module = types.ModuleType("raycap.capture.store")
    module.TokenCaptureStore = _FakeStore
    monkeypatch.setitem(sys.modules, "raycap.capture.store", module)
    _FakeStore.opened = []
    return _FakeStore


def snapshot(entries, incomplete=False):
    return TokenCaptureSnapshot(rollout_id="r", entries=tuple(entries), incomplete=incomplete, snapshot_id="s1", version=7)


def test_trajectories_without_directories_is_none():
    assert reference_trajectories_for_rollout("r", []) is None


def test_trajectories_freeze_failure_is_a_failed_build_without_snapshot(fake_store):
    fake_store.outcome = RuntimeError("rollout r is retired")
    assert reference_trajectories_for_rollout("r", ["/d1", "/d2"]) == reference_failed_build(
        "r", "prefix_merging", "RuntimeError: rollout r is retired"
    )
    assert fake_store.opened == ["/d1"]


def test_trajectories_of_a_complete_snapshot(fake_store):
    fake_store.outcome = snapshot(LINEAR)
    build = reference_trajectories_for_rollout("r", ["/d1", "/d2"], model="m")
    expected = reference_assemble("r", LINEAR, "prefix_merging", "m")
    expected["_capture_snapshot"] = {"snapshot_id": "s1", "version": 7}
    assert build == expected
    assert "capture_incomplete" not in build["metrics"]
    assert fake_store.opened == ["/d1"]


def test_trajectories_of_an_incomplete_snapshot_are_masked(fake_store):
    fake_store.outcome = snapshot(LINEAR, incomplete=True)
    build = reference_trajectories_for_rollout("r", ["/d1"])
    assert build["mask_sample"] is True
    assert build["metrics"]["capture_incomplete"] is True
    assert build["rebuilt_response"] is not None
    assert build["_capture_snapshot"] == {"snapshot_id": "s1", "version": 7}


def test_trajectories_of_an_empty_snapshot(fake_store):
    fake_store.outcome = snapshot([])
    expected = reference_failed_build("r", "per_request", "capture contains no token records")
    expected["_capture_snapshot"] = {"snapshot_id": "s1", "version": 7}
    assert reference_trajectories_for_rollout("r", ["/d1"], builder="per_request") == expected

    fake_store.outcome = snapshot([], incomplete=True)
    build = reference_trajectories_for_rollout("r", ["/d1"])
    assert build["error"] == "capture contains no token records"
    assert build["metrics"] == {"n_calls": 0, "capture_incomplete": True}
    assert build["_capture_snapshot"] == {"snapshot_id": "s1", "version": 7}


def test_trajectories_of_a_snapshot_with_per_request(fake_store):
    fake_store.outcome = snapshot(LINEAR)
    build = reference_trajectories_for_rollout("r", ["/d1"], builder="per_request")
    assert build["error"].startswith("per_request returns multiple trajectories")
    assert build["metrics"] == {"n_calls": 3}
    assert "_capture_snapshot" in build


def test_trajectories_from_a_capture_directory_on_disk(tmp_path):
    pytest.importorskip("raycap.capture.store")
    lines = [entry_line(entry) for entry in LINEAR]
    (tmp_path / "r.tokens.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    build = reference_trajectories_for_rollout("r", [tmp_path], model="m")
    assert build["rebuilt_response"] == reference_assemble("r", LINEAR, "prefix_merging", "m")["rebuilt_response"]
    assert build["mask_sample"] is False
    assert isinstance(build["_capture_snapshot"]["snapshot_id"], str) and build["_capture_snapshot"]["snapshot_id"]


# --- size -------------------------------------------------------------------------------


def _long_rollout(n_calls: int) -> list[TokenEntry]:
    """A main conversation with retries, side calls and one compaction: `n_calls` calls."""
    entries: list[TokenEntry] = []
    prompt = [1, 2, 3, 4]
    k = 0
    while True:
        if k == n_calls // 2:
            prompt = [9, 9, k]  # compaction: a fresh prompt, continued from here on
        extras = []
        if k % 10 == 5:
            extras.append(call(f"retry-{k:04d}", prompt, [3000 + k], created_at=k))  # abandoned attempt
        if k % 7 == 3 and k != n_calls // 2:
            extras.append(call(f"side-{k:04d}", prompt + [k], [4000 + k], created_at=k))
        gen = [1000 + k, 2000 + k, 7]
        for entry in extras + [call(f"main-{k:04d}", prompt, gen, created_at=k)]:
            entries.append(entry)
            if len(entries) == n_calls:
                return entries[::-1]  # capture order means nothing
        prompt = prompt + gen + [5000 + k, 6]
        k += 1


@pytest.mark.slow
def test_a_thousand_call_rollout_takes_seconds_at_most():
    entries = _long_rollout(1000)
    assert len(entries) == 1000
    started = time.perf_counter()
    build = reference_prefix_merging(entries)
    result = reference_assemble("long", entries, "prefix_merging", "m")
    elapsed = time.perf_counter() - started
    assert elapsed < 5.0, f"reference took {elapsed:.1f}s on 1,000 calls"
    main = next(chain for chain in build.chains if chain.chain_id == "main")
    # Every chain before the compaction starts at main-0000; the first leaf in processing
    # order (the earliest side call) wins the tie, as the spec orders it.
    assert [link.entry.model_call_id for link in main.links] == ["main-0000", "main-0001", "main-0002", "side-0003"]
    assert any(chain.links[-1].entry.model_call_id == "main-0499" and len(chain.links) == 500 for chain in build.chains)
    assert build.notes["roots"] == 2
    assert all(not call_id.startswith("main") for call_id in build.quarantined)
    assert len(build.notes["unresolved_retries"]) == 0
    assert result["metrics"]["n_calls"] == 1000 and result["rebuilt_response"] is not None


# --- properties -------------------------------------------------------------------------


def _processing_order(entries):
    return sorted(
        (entry for entry in entries if entry.generation_token_ids),
        key=lambda entry: (len(entry.prompt_token_ids), entry.model_call_id),
    )


def _naive_parents(entries) -> dict[str, tuple[str | None, bool]]:
    """call id -> (parent id, ambiguous), by trying every processed call: the spec's words."""
    order = _processing_order(entries)
    result = {}
    for i, entry in enumerate(order):
        prompt = entry.prompt_token_ids
        best = []
        for candidate in order[:i]:
            cumulative = candidate.prompt_token_ids + candidate.generation_token_ids
            if 0 < len(cumulative) <= len(prompt) and prompt[: len(cumulative)] == cumulative:
                best_length = len(best[0].prompt_token_ids + best[0].generation_token_ids) if best else 0
                if len(cumulative) > best_length:
                    best = [candidate]
                elif len(cumulative) == best_length:
                    best.append(candidate)
        result[entry.model_call_id] = (best[0].model_call_id if best else None, len(best) > 1)
    return result


def _comparable(build: BuildOutput):
    return (shape(build), build.quarantined, {**build.notes, "empty_generation_calls": sorted(build.notes.get("empty_generation_calls", []))})


# The reference's properties share each drawn rollout (drawing one costs far more than
# checking it): one property test runs every check below on it.
@PROPERTY
@given(st.data())
def test_the_reference_keeps_its_properties_on_random_rollouts(data):
    entries = data.draw(rollouts())
    _capture_order_does_not_change_the_result(entries, data.draw(st.permutations(entries)))
    _chains_follow_the_parent_rule_and_are_prefix_consistent(entries)
    _notes_agree_with_the_chains(entries)
    _assemble_never_raises_and_reports_a_known_error_kind(entries)


def _capture_order_does_not_change_the_result(entries, shuffled):
    assert _comparable(reference_prefix_merging(entries)) == _comparable(reference_prefix_merging(shuffled))
    assert shape(reference_per_request(entries)) == shape(reference_per_request(shuffled))


def _chains_follow_the_parent_rule_and_are_prefix_consistent(entries):
    build = reference_prefix_merging(entries)
    parents = _naive_parents(entries)
    children = {}
    for call_id, (parent, _) in parents.items():
        children.setdefault(parent, []).append(call_id)
    quarantined = set(build.quarantined)
    leaves = []
    for chain in build.chains:
        root = chain.links[0]
        assert root.interstitial == [] and chain.root_prompt == root.entry.prompt_token_ids
        assert parents[root.entry.model_call_id][0] is None
        running = root.entry.prompt_token_ids + root.entry.generation_token_ids
        previous = root.entry.model_call_id
        for link in chain.links[1:]:
            assert link.entry.prompt_token_ids == running + link.interstitial
            assert parents[link.entry.model_call_id][0] == previous
            running = link.entry.prompt_token_ids + link.entry.generation_token_ids
            previous = link.entry.model_call_id
        assert previous not in children, "a chain ends at a call without children"
        assert not any(link.entry.model_call_id in quarantined for link in chain.links)
        assert all(link.entry.generation_token_ids for link in chain.links)
        leaves.append(previous)
    assert len(set(leaves)) == len(leaves)
    # Ambiguous children are always quarantined.
    assert {call_id for call_id, (_, ambiguous) in parents.items() if ambiguous} <= quarantined
    # Leaves come in processing order.
    position = {entry.model_call_id: k for k, entry in enumerate(_processing_order(entries))}
    assert [position[leaf] for leaf in leaves] == sorted(position[leaf] for leaf in leaves)


def _notes_agree_with_the_chains(entries):
    build = reference_prefix_merging(entries)
    notes_ = build.notes
    order = [entry.model_call_id for entry in _processing_order(entries)]
    assert list(notes_) == list(notes(0, 0, 0, 0, 0.0))
    assert notes_["chains"] == len(build.chains)
    assert notes_["roots"] == sum(1 for parent, _ in _naive_parents(entries).values() if parent is None)
    assert notes_["empty_generation_calls"] == [e.model_call_id for e in entries if not e.generation_token_ids]
    captured = sum(len(e.generation_token_ids) for e in entries)
    assert notes_["generated_tokens_captured"] == captured
    names = [chain.chain_id for chain in build.chains]
    if build.chains:
        assert names.count("main") == 1
        assert [name for name in names if name != "main"] == [f"branch-{k}" for k in range(len(names) - 1)]
        main = build.chains[names.index("main")]
        assert notes_["generated_tokens_delivered"] == sum(len(link.entry.generation_token_ids) for link in main.links)
        roots = [chain.links[0].entry for chain in build.chains]
        assert min((r.created_at, r.model_call_id) for r in roots) == (main.links[0].entry.created_at, main.links[0].entry.model_call_id)
    else:
        assert notes_["generated_tokens_delivered"] == 0
    delivered = notes_["generated_tokens_delivered"]
    assert notes_["delivered_fraction"] == (round(delivered / captured, 4) if captured else 0.0)
    assert build.quarantined == [call_id for call_id in order if call_id in set(build.quarantined)]
    unresolved = notes_["unresolved_retries"]
    assert len(set(unresolved)) == len(unresolved) and set(unresolved) <= set(order)


def _assemble_never_raises_and_reports_a_known_error_kind(entries):
    for builder in ("prefix_merging", "per_request"):
        build = reference_assemble("r", entries, builder, "m")
        assert build["metrics"]["n_calls"] == len(entries)
        if build["rebuilt_response"] is None:
            assert build["mask_sample"] is True
            if builder == "per_request":
                assert build["error"] == PER_REQUEST_UNSUPPORTED
            else:
                assert build["error"].split(":")[0] in {"AssertionError", "ValueError", "KeyError", "IndexError", "TypeError"}


@pytest.mark.slow
@PROPERTY
@given(rollouts(odd_items=False))
def test_well_formed_items_project_the_whole_main_chain(entries):
    build = reference_prefix_merging(entries)
    result = reference_assemble("r", entries, "prefix_merging", "m")
    if not build.chains:
        assert result["error"] == "ValueError: capture produced no safe trainable chain"
        return
    response = result["rebuilt_response"]
    main = next(chain for chain in build.chains if chain.chain_id == "main")
    assert response["usage"] == {
        "input_tokens": len(main.root_prompt),
        "output_tokens": build.notes["generated_tokens_delivered"],
    }
    carried = [item["generation_token_ids"] for item in response["output"] if item.get("generation_token_ids") is not None]
    assert carried == [link.entry.generation_token_ids for link in main.links]
    assert result["mask_sample"] == bool(
        build.notes["unresolved_retries"] or build.notes["roots"] != 1 or build.notes["chains"] != 1
    )
