"""Tests for raycap.capture.consumer: the single-rollout build dicts, the capture configuration and
clearing stale captures (SPEC section 5). No Ray here."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pydantic
import pytest

from collection import _append_rollout
from raycap.capture import consumer
from raycap.capture.consumer import (
    RolloutBuild,
    _assemble,
    _failed_build,
    build_local,
    clear_token_captures_for_rollouts,
    install_token_sink,
    rollout_id_from_record,
    token_id_capture_dirs_from_config,
    trajectories_for_rollout,
    trajectories_from_source,
)
from raycap.capture.records import TokenEntry, entry_line
from raycap.capture.store import TokenCaptureStore

REPO_ROOT = Path(__file__).resolve().parents[2]
SUCCESS_KEYS = {"rollout_id", "builder", "rebuilt_response", "metrics", "mask_sample", "unresolved_retries"}
FAILED_KEYS = {"rollout_id", "builder", "rebuilt_response", "mask_sample", "error", "metrics"}
METRIC_KEYS = {
    "n_calls",
    "chains",
    "roots",
    "quarantined_calls",
    "quarantined_fraction",
    "delivered_fraction",
    "generated_tokens_captured",
    "generated_tokens_delivered",
    "empty_generation_calls",
}


def entry(call_id: str, prompt: list, gen: list, log_probs: list | None = None, *, rollout_id: str = "r1", **extra):
    """A valid record; log probs default to exact binary fractions."""
    if log_probs is None:
        log_probs = [-(k + 1) / 8 for k in range(len(gen))]
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=log_probs,
        **extra,
    )


def linear(rollout_id: str = "r1") -> list[TokenEntry]:
    """Two calls, the second continuing the first after two tool tokens."""
    return [
        entry(
            "c1",
            [1, 2, 3],
            [4, 5],
            [-0.5, -0.25],
            rollout_id=rollout_id,
            output_items=[{"type": "reasoning", "summary": []}, {"type": "message", "content": "a"}],
            token_item_index=1,
            created_at=1.0,
        ),
        entry("c2", [1, 2, 3, 4, 5, 6, 7], [8], [-0.125], rollout_id=rollout_id, created_at=2.0),
    ]


def write(directory: Path, entries: list[TokenEntry]) -> TokenCaptureStore:
    store = TokenCaptureStore(directory)
    for item in entries:
        store.append(item)
    return store


def write_raw(directory: Path, rollout_id: str, lines: list[bytes]) -> None:
    """Lines written by another writer that keeps no index (the store indexes them on freeze)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{rollout_id}.tokens.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))


def one_call(items: list[dict], index: int | None) -> dict:
    """The build of a one-call rollout (prompt [1, 2], generation [3]) with these items."""
    call = entry("c1", [1, 2], [3], [-0.5], output_items=items, token_item_index=index)
    return _assemble("r1", [call], "prefix_merging", "")


# -- _failed_build and _assemble ----------------------------------------------------------------


def test_failed_build_is_exactly_the_spec_dict():
    assert _failed_build("r1", "prefix_merging", "boom", 3) == {
        "rollout_id": "r1",
        "builder": "prefix_merging",
        "rebuilt_response": None,
        "mask_sample": True,
        "error": "boom",
        "metrics": {"n_calls": 3},
    }
    assert _failed_build("r2", "per_request", "x")["metrics"] == {"n_calls": 0}


def test_assemble_refuses_per_request():
    entries = linear()
    assert _assemble("r1", entries, "per_request", "m") == {
        "rollout_id": "r1",
        "builder": "per_request",
        "rebuilt_response": None,
        "mask_sample": True,
        "error": "per_request returns multiple trajectories and is not supported by "
        "single-response delivery",
        "metrics": {"n_calls": 2},
    }


def test_assemble_refuses_per_request_even_for_one_call():
    build = _assemble("r1", linear()[:1], "per_request", "")
    assert build["error"].startswith("per_request returns multiple trajectories")
    assert build["metrics"] == {"n_calls": 1}


def test_assemble_success_is_exactly_the_spec_dict():
    entries = linear()
    before = copy.deepcopy([e.model_dump() for e in entries])
    build = _assemble("r1", list(reversed(entries)), "prefix_merging", "my-model")
    assert build == {
        "rollout_id": "r1",
        "builder": "prefix_merging",
        "rebuilt_response": {
            "id": "proj-r1",
            "model": "my-model",
            "object": "response",
            "output": [
                {"type": "reasoning", "summary": []},
                {
                    "type": "message",
                    "content": "a",
                    "prompt_token_ids": [1, 2, 3],
                    "generation_token_ids": [4, 5],
                    "generation_log_probs": [-0.5, -0.25],
                },
                {
                    "type": "message",
                    "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7],
                    "generation_token_ids": [8],
                    "generation_log_probs": [-0.125],
                },
            ],
            "usage": {"input_tokens": 3, "output_tokens": 3},
        },
        "metrics": {
            "n_calls": 2,
            "chains": 1,
            "roots": 1,
            "quarantined_calls": 0,
            "quarantined_fraction": 0.0,
            "delivered_fraction": 1.0,
            "generated_tokens_captured": 3,
            "generated_tokens_delivered": 3,
            "empty_generation_calls": 0,
        },
        "mask_sample": False,
        "unresolved_retries": [],
    }
    # Projection works on copies: the records keep their items without token arrays.
    assert [e.model_dump() for e in entries] == before
    # Plain JSON types all the way down, so the dict serialises as is.
    assert json.loads(json.dumps(build)) == build


def test_assemble_rounds_fractions_to_four_places():
    # c2b is a retry of c2a that was not continued: quarantined, 1 of 6 calls.
    entries = [
        entry("c1", [1], [2]),
        entry("c2a", [1, 2, 3], [4]),
        entry("c2b", [1, 2, 3], [5]),
        entry("c3", [1, 2, 3, 4, 6], [7]),
        entry("c4", [1, 2, 3, 4, 6, 7, 8], [9]),
        entry("c5", [1, 2, 3, 4, 6, 7, 8, 9, 10], [11]),
    ]
    build = _assemble("r1", entries, "prefix_merging", "")
    metrics = build["metrics"]
    assert set(metrics) == METRIC_KEYS
    assert metrics["quarantined_calls"] == 1
    assert metrics["quarantined_fraction"] == 0.1667
    assert metrics["generated_tokens_captured"] == 6
    assert metrics["generated_tokens_delivered"] == 5
    assert metrics["delivered_fraction"] == 0.8333
    assert (metrics["roots"], metrics["chains"]) == (1, 1)
    assert build["unresolved_retries"] == []
    assert build["mask_sample"] is False


def test_assemble_counts_empty_generation_calls():
    entries = [entry("c0", [1], []), entry("c1", [1], [2]), entry("c9", [1, 2, 3], [])]
    build = _assemble("r1", entries, "prefix_merging", "")
    assert build["metrics"]["empty_generation_calls"] == 2
    assert build["metrics"]["n_calls"] == 3
    assert build["metrics"]["generated_tokens_captured"] == 1


def test_mask_for_unresolved_retries_only():
    entries = [entry("c1", [1], [2]), entry("c2b", [1, 2, 3], [5]), entry("c2a", [1, 2, 3], [4])]
    build = _assemble("r1", entries, "prefix_merging", "")
    assert (build["metrics"]["roots"], build["metrics"]["chains"]) == (1, 1)
    assert build["unresolved_retries"] == ["c2a", "c2b"]
    assert build["mask_sample"] is True
    assert set(build) == SUCCESS_KEYS


def test_mask_for_two_roots_only():
    # The first call was retried and the conversation continued from one attempt.
    entries = [entry("c1a", [1], [2]), entry("c1b", [1], [3]), entry("c2", [1, 2, 9], [4])]
    build = _assemble("r1", entries, "prefix_merging", "")
    metrics = build["metrics"]
    assert (metrics["roots"], metrics["chains"]) == (2, 1)
    assert build["unresolved_retries"] == []
    assert metrics["quarantined_calls"] == 1
    assert metrics["quarantined_fraction"] == 0.3333
    assert build["mask_sample"] is True


def test_mask_for_two_chains_only():
    # A side call on a prefix of the history is a branch.
    entries = [entry("c1", [1], [2]), entry("c2", [1, 2, 3], [4]), entry("side", [1, 2, 7], [5])]
    build = _assemble("r1", entries, "prefix_merging", "")
    assert (build["metrics"]["roots"], build["metrics"]["chains"]) == (1, 2)
    assert build["unresolved_retries"] == []
    assert build["mask_sample"] is True
    # Only the main chain is delivered.
    assert build["metrics"]["generated_tokens_delivered"] == 2
    assert build["metrics"]["delivered_fraction"] == 0.6667


def test_one_root_one_chain_no_retries_is_not_masked():
    build = _assemble("r1", [entry("only", [5, 6], [7, 8, 9])], "prefix_merging", "")
    assert build["mask_sample"] is False
    assert build["rebuilt_response"]["usage"] == {"input_tokens": 2, "output_tokens": 3}


# -- carriers ------------------------------------------------------------------------------------


def output_of(*entries: TokenEntry) -> list[dict]:
    build = _assemble("r1", list(entries), "prefix_merging", "")
    assert "error" not in build, build.get("error")
    return build["rebuilt_response"]["output"]


def test_carrier_is_the_item_at_token_item_index():
    items = [{"type": "reasoning"}, {"type": "function_call", "name": "f"}, {"type": "message"}]
    output = output_of(entry("c1", [1], [2, 3], [-0.5, -1.0], output_items=items, token_item_index=1))
    assert output == [
        {"type": "reasoning"},
        {
            "type": "function_call",
            "name": "f",
            "prompt_token_ids": [1],
            "generation_token_ids": [2, 3],
            "generation_log_probs": [-0.5, -1.0],
        },
        {"type": "message"},
    ]


def test_legacy_records_carry_on_every_inline_item():
    # Older records kept the arrays on the item that carried them and had no index; an
    # item whose inline generation is null is not a carrier.
    items = [
        {"type": "reasoning", "generation_token_ids": None},
        {"type": "message", "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]},
        {"type": "note"},
    ]
    output = output_of(entry("c1", [1], [2], [-0.5], output_items=items))
    assert output == [
        {"type": "reasoning", "generation_token_ids": None},
        {"type": "message", "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]},
        {"type": "note"},
    ]
    second = entry(
        "c2",
        [1, 2, 3],
        [4],
        [-0.25],
        output_items=[
            {"type": "message", "prompt_token_ids": [9], "generation_token_ids": [9], "generation_log_probs": [0.0]}
        ],
    )
    output = output_of(entry("c1", [1], [2], [-0.5], output_items=items), second)
    # The inline arrays are replaced by the running sequence and the captured values.
    assert output[-1] == {
        "type": "message",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4],
        "generation_log_probs": [-0.25],
    }


def test_carrier_defaults_to_the_last_item():
    items = [{"type": "reasoning"}, {"type": "message", "content": "x"}]
    output = output_of(entry("c1", [1], [2], [-0.5], output_items=items))
    assert output[0] == {"type": "reasoning"}
    assert output[1] == {
        "type": "message",
        "content": "x",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-0.5],
    }


def test_a_call_without_items_becomes_one_message_item():
    output = output_of(entry("c1", [1], [2], [-0.5]))
    assert output == [
        {"type": "message", "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]}
    ]


def test_routed_experts_only_when_not_null():
    routed = [[[0, 3], [1, 2]]]
    output = output_of(
        entry("c1", [1], [2], [-0.5], routed_experts=routed),
        entry("c2", [1, 2, 3], [4], [-0.25]),
    )
    assert output[0]["routed_experts"] == routed
    assert "routed_experts" not in output[1]


def test_projection_items_do_not_share_lists_with_the_records():
    e = entry("c1", [1], [2], [-0.5], output_items=[{"type": "message", "content": ["a"]}], token_item_index=0)
    output = output_of(e)
    output[0]["generation_token_ids"].append(99)
    assert e.generation_token_ids == [2]
    assert "generation_token_ids" not in e.output_items[0]


# -- _assemble failures ---------------------------------------------------------------------------


def test_no_chain_is_a_failed_build():
    entries = [entry("c1", [1], []), entry("c2", [1, 2], [])]
    assert _assemble("r1", entries, "prefix_merging", "") == _failed_build(
        "r1", "prefix_merging", "ValueError: capture produced no safe trainable chain", 2
    )


def test_ambiguous_parents_only_is_a_failed_build():
    # Two identical calls are unresolved retries and their child's parent is ambiguous,
    # so every path holds a quarantined call.
    entries = [entry("a", [1], [2]), entry("b", [1], [2]), entry("c", [1, 2, 3], [4])]
    assert _assemble("r1", entries, "prefix_merging", "") == _failed_build(
        "r1", "prefix_merging", "ValueError: capture produced no safe trainable chain", 3
    )


def test_unknown_builder_is_a_failed_build(caplog):
    with caplog.at_level(logging.WARNING):
        build = _assemble("r-unknown", linear(), "nope", "")
    assert build["error"] == "ValueError: unknown builder 'nope'; known builders: per_request, prefix_merging"
    assert build["metrics"] == {"n_calls": 2}
    assert any("r-unknown" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_non_contiguous_projection_is_an_assertion_error(caplog):
    # An old record's non-carrier item still holds arrays that do not fit the sequence.
    items = [
        {"type": "reasoning", "prompt_token_ids": [99], "generation_token_ids": [98], "generation_log_probs": [0.0]},
        {"type": "message"},
    ]
    call = entry("c1", [1, 2], [3], [-0.5], rollout_id="r-gap", output_items=items, token_item_index=1)
    with caplog.at_level(logging.WARNING):
        build = _assemble("r-gap", [call], "prefix_merging", "")
    assert build["error"].startswith("AssertionError: projection is not prefix-contiguous")
    assert set(build) == FAILED_KEYS
    assert build["metrics"] == {"n_calls": 1}
    assert any("r-gap" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_null_prompt_on_the_first_token_bearing_item_is_a_type_error():
    # input_tokens is the length of that prompt, and a null has no length.
    items = [
        {"type": "reasoning", "prompt_token_ids": None, "generation_token_ids": [], "generation_log_probs": []},
        {"type": "message"},
    ]
    build = one_call(items, 1)
    assert build["error"].startswith("TypeError: ")
    assert build["metrics"] == {"n_calls": 1}


def test_null_prompt_counts_as_empty_in_the_contiguity_check():
    items = [
        {"type": "reasoning", "prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": []},
        {"type": "reasoning", "prompt_token_ids": None, "generation_token_ids": [], "generation_log_probs": []},
        {"type": "message"},
    ]
    build = one_call(items, 2)
    assert "error" not in build, build.get("error")
    assert build["rebuilt_response"]["usage"] == {"input_tokens": 0, "output_tokens": 1}
    assert build["rebuilt_response"]["output"][1]["prompt_token_ids"] is None


def test_null_prompt_after_tokens_breaks_contiguity():
    second = entry(
        "c2",
        [1, 2, 3, 4],
        [5],
        [-0.5],
        output_items=[
            {"type": "reasoning", "prompt_token_ids": None, "generation_token_ids": [], "generation_log_probs": []},
            {"type": "message"},
        ],
        token_item_index=1,
    )
    build = _assemble("r1", [entry("c1", [1, 2], [3]), second], "prefix_merging", "")
    assert build["error"].startswith("AssertionError: projection is not prefix-contiguous")


def test_missing_prompt_on_the_first_token_bearing_item_is_a_key_error():
    items = [{"type": "reasoning", "generation_token_ids": [7], "generation_log_probs": [0.0]}, {"type": "message"}]
    build = one_call(items, 1)
    assert build["error"].startswith("KeyError: ")
    assert "prompt_token_ids" in build["error"]
    assert build["metrics"] == {"n_calls": 1}


def test_log_prob_count_mismatch_in_a_chain_is_a_value_error():
    bad = TokenEntry.model_construct(
        rollout_id="r1",
        model_call_id="c2",
        prompt_token_ids=[1, 2, 3],
        generation_token_ids=[4, 5],
        generation_log_probs=[-0.5],
        output_items=[],
        token_item_index=None,
        routed_experts=None,
        created_at=0.0,
        model="",
        schema_version=1,
    )
    build = _assemble("r1", [entry("c1", [1], [2]), bad], "prefix_merging", "")
    assert build["error"].startswith("ValueError: ")
    assert "c2" in build["error"]
    assert build["mask_sample"] is True and build["rebuilt_response"] is None


def test_unusable_token_arrays_are_a_type_error():
    bad = TokenEntry.model_construct(
        rollout_id="r1",
        model_call_id="c1",
        prompt_token_ids=[1, None],
        generation_token_ids=[4],
        generation_log_probs=[-0.5],
        output_items=[],
        token_item_index=None,
        routed_experts=None,
        created_at=0.0,
        model="",
        schema_version=1,
    )
    build = _assemble("r1", [bad], "prefix_merging", "")
    assert build["error"].startswith("TypeError: ")
    assert build["metrics"] == {"n_calls": 1}


# -- trajectories_for_rollout -----------------------------------------------------------------


def state_of(directory: Path, rollout_id: str) -> dict:
    return json.loads((directory / f"{rollout_id}.tokens.state.json").read_bytes())


@pytest.mark.parametrize("dirs", [[], ()])
def test_no_directories_is_none(dirs):
    assert trajectories_for_rollout("r1", dirs) is None


def test_a_complete_capture_builds_with_its_snapshot(tmp_path):
    directory = tmp_path / "caps"
    write(directory, linear())
    build = trajectories_for_rollout("r1", [directory], model="m")
    expected = _assemble("r1", linear(), "prefix_merging", "m")
    snapshot = build.pop("_capture_snapshot")
    assert build == expected
    assert "capture_incomplete" not in build["metrics"]
    state = state_of(directory, "r1")
    assert state["frozen"] is True
    assert snapshot == {"snapshot_id": state["snapshot_id"], "version": state["version"]}
    assert re.fullmatch(r"[0-9a-f]{32}", snapshot["snapshot_id"])
    # Two appends and the freeze.
    assert snapshot["version"] == 3


def test_directories_may_be_strings(tmp_path):
    write(tmp_path, linear())
    build = trajectories_for_rollout("r1", [str(tmp_path)])
    assert build["rebuilt_response"]["id"] == "proj-r1"


def test_freezing_again_gives_the_same_snapshot(tmp_path):
    write(tmp_path, linear())
    first = trajectories_for_rollout("r1", [tmp_path])
    second = trajectories_for_rollout("r1", [tmp_path])
    assert first == second


def test_only_the_first_directory_is_used(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    write(first, linear())
    write(second, [entry("other", [7], [8])])
    build = trajectories_for_rollout("r1", [first, second])
    assert build["metrics"]["n_calls"] == 2
    assert state_of(first, "r1")["frozen"] is True
    assert state_of(second, "r1")["frozen"] is False
    # The rollout only in the second directory: the first has no records for it.
    build = trajectories_for_rollout("r1", [tmp_path / "empty", second])
    assert build["error"] == "capture contains no token records"
    assert state_of(second, "r1")["frozen"] is False


def test_no_records_is_a_failed_build_with_its_snapshot(tmp_path):
    build = trajectories_for_rollout("r-none", [tmp_path], builder="prefix_merging")
    snapshot = build.pop("_capture_snapshot")
    assert build == {
        "rollout_id": "r-none",
        "builder": "prefix_merging",
        "rebuilt_response": None,
        "mask_sample": True,
        "error": "capture contains no token records",
        "metrics": {"n_calls": 0},
    }
    assert snapshot == {"snapshot_id": state_of(tmp_path, "r-none")["snapshot_id"], "version": 1}


def test_per_request_through_a_directory_keeps_the_snapshot(tmp_path):
    write(tmp_path, linear())
    build = trajectories_for_rollout("r1", [tmp_path], builder="per_request")
    assert build["error"].startswith("per_request returns multiple trajectories")
    assert build["metrics"] == {"n_calls": 2}
    assert set(build) == FAILED_KEYS | {"_capture_snapshot"}


def test_incomplete_capture_is_masked_and_flagged(tmp_path):
    store = write(tmp_path, linear())
    store.mark_incomplete_now("r1", "c3")
    build = trajectories_for_rollout("r1", [tmp_path])
    assert build["mask_sample"] is True
    assert build["metrics"]["capture_incomplete"] is True
    assert "error" not in build
    # Everything else is the normal build.
    del build["metrics"]["capture_incomplete"], build["_capture_snapshot"]
    expected = _assemble("r1", linear(), "prefix_merging", "")
    assert build == {**expected, "mask_sample": True}


def test_an_announced_call_without_a_record_makes_the_capture_incomplete(tmp_path):
    store = write(tmp_path, linear())
    store.begin_call_now("r1", "c2")
    store.begin_call_now("r1", "c3")
    build = trajectories_for_rollout("r1", [tmp_path])
    assert build["mask_sample"] is True and build["metrics"]["capture_incomplete"] is True


def test_an_incomplete_capture_without_records_is_flagged_too(tmp_path):
    TokenCaptureStore(tmp_path).mark_incomplete_now("r1", "c1")
    build = trajectories_for_rollout("r1", [tmp_path])
    assert build["error"] == "capture contains no token records"
    assert build["metrics"] == {"n_calls": 0, "capture_incomplete": True}
    assert "_capture_snapshot" in build


def test_incomplete_and_failed_build_stays_failed(tmp_path):
    store = write(tmp_path, linear())
    store.mark_incomplete_now("r1")
    build = trajectories_for_rollout("r1", [tmp_path], builder="per_request")
    assert build["error"].startswith("per_request returns")
    assert build["metrics"] == {"n_calls": 2, "capture_incomplete": True}


def assert_freeze_failure(build: dict, rollout_id: str, kind: str) -> None:
    assert set(build) == FAILED_KEYS, "a failed freeze has no snapshot"
    assert build["rollout_id"] == rollout_id
    assert build["rebuilt_response"] is None
    assert build["mask_sample"] is True
    assert build["metrics"] == {"n_calls": 0}
    assert build["error"].startswith(kind + ": "), build["error"]


def test_retired_rollout_is_a_runtime_error(tmp_path, caplog):
    store = write(tmp_path, linear())
    snapshot = store.freeze_now("r1")
    assert store.drop_now("r1", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    with caplog.at_level(logging.WARNING):
        build = trajectories_for_rollout("r1", [tmp_path])
    assert_freeze_failure(build, "r1", "RuntimeError")
    assert "retired" in build["error"]
    assert any("r1" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_corrupt_jsonl_line_is_a_json_decode_error(tmp_path, caplog):
    lines = [entry_line(e) for e in linear("r-corrupt")]
    write_raw(tmp_path, "r-corrupt", [lines[0], lines[1][: len(lines[1]) // 2], lines[1]])
    with caplog.at_level(logging.WARNING):
        build = trajectories_for_rollout("r-corrupt", [tmp_path])
    assert_freeze_failure(build, "r-corrupt", "JSONDecodeError")
    assert any("r-corrupt" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_newer_schema_record_is_a_validation_error(tmp_path, caplog):
    good, newer = linear("r-new")
    raw = json.loads(entry_line(newer))
    raw["schema_version"] = 2
    write_raw(tmp_path, "r-new", [entry_line(good), json.dumps(raw, sort_keys=True).encode()])
    with caplog.at_level(logging.WARNING):
        build = trajectories_for_rollout("r-new", [tmp_path])
    assert_freeze_failure(build, "r-new", "ValidationError")
    assert "up to 1" in build["error"]
    assert any("r-new" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_log_prob_length_mismatch_record_is_a_validation_error(tmp_path):
    raw = json.loads(entry_line(linear("r-lp")[0]))
    raw["generation_log_probs"] = raw["generation_log_probs"][:1]
    write_raw(tmp_path, "r-lp", [json.dumps(raw).encode()])
    build = trajectories_for_rollout("r-lp", [tmp_path])
    assert_freeze_failure(build, "r-lp", "ValidationError")
    assert "same length" in build["error"]


def test_bad_carrier_index_record_is_a_validation_error(tmp_path):
    raw = json.loads(entry_line(linear("r-idx")[0]))
    raw["token_item_index"] = 7
    write_raw(tmp_path, "r-idx", [json.dumps(raw).encode()])
    assert_freeze_failure(trajectories_for_rollout("r-idx", [tmp_path]), "r-idx", "ValidationError")


@pytest.mark.parametrize("rollout_id", ["bad/id", "../escape", "", "a b", "r\n1", "é"])
def test_invalid_rollout_id_is_a_value_error_and_touches_nothing(tmp_path, caplog, rollout_id):
    directory = tmp_path / "caps"
    directory.mkdir()
    with caplog.at_level(logging.WARNING):
        build = trajectories_for_rollout(rollout_id, [directory])
    assert_freeze_failure(build, rollout_id, "ValueError")
    assert list(directory.iterdir()) == []
    assert list(tmp_path.iterdir()) == [directory]
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_a_directory_that_is_a_file_is_a_masked_result(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    build = trajectories_for_rollout("r1", [path])
    assert build["mask_sample"] is True and build["rebuilt_response"] is None
    assert re.match(r"[A-Za-z]+Error: ", build["error"]), build["error"]


def test_torn_final_line_is_recovered(tmp_path):
    lines = [entry_line(e) for e in linear("r-torn")]
    directory = tmp_path
    (directory / "r-torn.tokens.jsonl").write_bytes(lines[0] + b"\n" + lines[1] + b"\n" + lines[1][:20])
    build = trajectories_for_rollout("r-torn", [directory])
    assert "error" not in build
    assert build["metrics"]["n_calls"] == 2


def test_build_local_is_the_typed_form_of_the_same_build(tmp_path):
    write(tmp_path, linear())
    result = build_local("r1", tmp_path, model="m")
    assert isinstance(result, RolloutBuild)
    assert result.to_build() == trajectories_for_rollout("r1", [tmp_path], model="m")


# -- trajectories_from_source ---------------------------------------------------------------


@pytest.mark.slow
def test_source_gives_the_same_builds_as_the_directory(fault_corpus, corpus_copy, comparable):
    local_dir, source_dir = corpus_copy("local"), corpus_copy("source")
    source = TokenCaptureStore(source_dir)

    async def from_source() -> list[dict | None]:
        return [await trajectories_from_source(rid, source) for rid in fault_corpus.rollout_ids]

    remote = asyncio.run(from_source())
    kinds = set()
    for rid, got in zip(fault_corpus.rollout_ids, remote):
        local = trajectories_for_rollout(rid, [local_dir])
        assert comparable(got, source_dir) == comparable(local, local_dir), rid
        if got.get("error"):
            kinds.add(got["error"].split(":", 1)[0])
    # The corpus covers successes and every failure kind of a freeze.
    assert {"RuntimeError", "JSONDecodeError", "ValidationError"} <= kinds
    assert any(b.get("error") is None for b in remote)
    assert any(b["metrics"].get("capture_incomplete") for b in remote)


def test_source_freeze_failure_is_a_failed_build_without_snapshot(tmp_path):
    class Broken:
        async def freeze(self, rollout_id):
            raise RuntimeError(f"Token capture for rollout {rollout_id} is retired")

    build = asyncio.run(trajectories_from_source("r1", Broken()))
    assert build == _failed_build("r1", "prefix_merging", "RuntimeError: Token capture for rollout r1 is retired")


def test_source_assembly_runs_off_the_event_loop(tmp_path, caplog):
    write(tmp_path, linear())
    loop_threads = []

    async def run():
        loop_threads.append(threading.get_ident())
        return await trajectories_from_source("r1", TokenCaptureStore(tmp_path), builder="nope")

    with caplog.at_level(logging.WARNING):
        build = asyncio.run(run())
    assert build["error"].startswith("ValueError: unknown builder")
    assert "_capture_snapshot" in build
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "r1" in r.getMessage()]
    assert warnings
    assert all(r.thread != loop_threads[0] for r in warnings)


# -- configuration ----------------------------------------------------------------------------


def test_enabled_block_with_a_directory(tmp_path):
    config = {"token_id_capture": {"enabled": True, "dir": str(tmp_path)}}
    assert token_id_capture_dirs_from_config(config) == [tmp_path]


def test_disabled_block_gives_no_directory(tmp_path):
    assert token_id_capture_dirs_from_config({"token_id_capture": {"enabled": False, "dir": str(tmp_path)}}) == []
    assert token_id_capture_dirs_from_config({"token_id_capture": {"dir": str(tmp_path)}}) == []


def test_a_configured_sink_replaces_the_directory(tmp_path):
    config = {"token_id_capture": {"enabled": True, "dir": str(tmp_path), "sink": "my.module:Sink"}}
    assert token_id_capture_dirs_from_config(config) == []
    # With a sink, no directory is needed.
    assert token_id_capture_dirs_from_config({"token_id_capture": {"enabled": True, "sink": "my.module:Sink"}}) == []


def test_an_installed_sink_makes_the_directory_optional():
    install_token_sink(object())
    try:
        assert token_id_capture_dirs_from_config({"token_id_capture": {"enabled": True}}) == []
    finally:
        install_token_sink(None)
    with pytest.raises(ValueError):
        token_id_capture_dirs_from_config({"token_id_capture": {"enabled": True}})


def test_fallback_to_model_call_capture_dir(tmp_path):
    config = {"model_call_capture_dir": str(tmp_path), "token_id_capture": {"enabled": True}}
    assert token_id_capture_dirs_from_config(config) == [tmp_path]
    # The block's own directory wins.
    own = tmp_path / "own"
    config["token_id_capture"]["dir"] = str(own)
    assert token_id_capture_dirs_from_config(config) == [own]


def test_all_documented_keys_are_accepted(tmp_path):
    block = {
        "enabled": True,
        "all_agents": True,
        "dir": str(tmp_path),
        "sink": None,
        "sink_kwargs": {"a": 1},
        "rebuild_response": True,
        "max_mask_fraction": 0.5,
        "mask_fraction_min_samples": 10,
    }
    assert token_id_capture_dirs_from_config({"token_id_capture": block}) == [tmp_path]


def test_read_only_mappings_are_accepted(tmp_path):
    config = MappingProxyType({"token_id_capture": MappingProxyType({"enabled": True, "dir": str(tmp_path)})})
    assert token_id_capture_dirs_from_config(config) == [tmp_path]


@pytest.mark.parametrize("block", [{"enabled": True, "dirr": "/x"}, {"enable": False}, {"max_mask_fraction": 1.5}])
def test_unknown_keys_and_bad_values_are_refused(block):
    with pytest.raises(pydantic.ValidationError):
        token_id_capture_dirs_from_config({"token_id_capture": block})


def test_enabled_without_a_directory_is_an_error():
    # The config's own check (SPEC 10.1): a ValidationError, which is a ValueError.
    with pytest.raises(pydantic.ValidationError, match="token_id_capture requires a directory or sink"):
        token_id_capture_dirs_from_config({"token_id_capture": {"enabled": True}})


@pytest.mark.parametrize("relative", ["captures", "./captures", "a/b"])
def test_enabled_with_a_relative_directory_is_an_error(relative):
    with pytest.raises(ValueError) as info:
        token_id_capture_dirs_from_config({"token_id_capture": {"enabled": True, "dir": relative}})
    assert relative in str(info.value)
    with pytest.raises(ValueError):
        token_id_capture_dirs_from_config({"model_call_capture_dir": relative, "token_id_capture": {"enabled": True}})


def test_no_rebuild_needs_no_directory():
    assert token_id_capture_dirs_from_config({"token_id_capture": {"enabled": True, "rebuild_response": False}}) == []


@pytest.mark.parametrize("config", [{}, None, {"model_call_capture_dir": "/tmp/x"}, {"other": {"enabled": True}}])
def test_missing_block_gives_no_directory(config):
    assert token_id_capture_dirs_from_config(config) == []


# -- rollout ids of run records and clearing ---------------------------------------------------


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"_ng_rollout_id": "task-7.r_2"}, "task-7.r_2"),
        ({"_ng_rollout_id": "abc", "_ng_task_index": 1, "_ng_rollout_index": 2}, "abc"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 7}, "3-7"),
        ({"_ng_task_index": 0, "_ng_rollout_index": 0}, "0-0"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 7, "_ng_attempt_index": 2}, "3-7-a2"),
        ({"_ng_task_index": 3, "_ng_rollout_index": 7, "_ng_attempt_index": 0}, "3-7"),
        ({"_ng_rollout_id": "x", "_ng_attempt_index": 1}, "x-a1"),
        ({"_ng_task_index": 3}, None),
        ({"_ng_rollout_index": 7}, None),
        ({"_ng_task_index": 3, "_ng_rollout_index": None}, None),
        ({}, None),
        ({"_ng_attempt_index": 2}, None),
    ],
)
def test_rollout_id_from_record(record, expected):
    assert rollout_id_from_record(record) == expected


def test_rollout_id_from_a_pydantic_record_and_none_from_other_objects():
    class Body(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="allow")

    assert rollout_id_from_record(Body(_ng_task_index=4, _ng_rollout_index=1, _ng_attempt_index=3)) == "4-1-a3"
    assert rollout_id_from_record(Body()) is None
    # Only a pydantic model or a Mapping is a run body (SPEC 10.5).
    assert rollout_id_from_record(SimpleNamespace(_ng_task_index=4, _ng_rollout_index=1)) is None


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "-leading-dash",
        ".hidden",
        "a b",
        "a/b",
        "é",
        "x\ny",
        5,
    ],
)
def test_invalid_explicit_rollout_id_is_refused(bad):
    prefix = "_ng_rollout_id must be a string of letters, digits, dots, dashes or underscores"
    with pytest.raises(ValueError) as caught:
        rollout_id_from_record({"_ng_rollout_id": bad})
    assert str(caught.value).startswith(prefix)


def test_an_id_with_a_final_newline_passes_the_pattern_as_applied_and_the_store_refuses_it(tmp_path):
    # The pattern is applied with `.match` (SPEC 10.5), where `$` also matches before a
    # final newline; such an id never names a capture file.
    assert rollout_id_from_record({"_ng_rollout_id": "x\n"}) == "x\n"
    write(tmp_path, [entry("c1", [1], [2], rollout_id="x")])
    with pytest.raises(ValueError, match="Invalid rollout id"):
        clear_token_captures_for_rollouts([{"_ng_rollout_id": "x"}, {"_ng_rollout_id": "x\n"}], [tmp_path])
    assert TokenCaptureStore(tmp_path).rollout_ids() == ["x"]


def test_an_attempt_index_int_refuses_raises_its_own_error():
    with pytest.raises(ValueError, match="invalid literal for int"):
        rollout_id_from_record({"_ng_task_index": 1, "_ng_rollout_index": 2, "_ng_attempt_index": "two"})
    with pytest.raises(TypeError):
        rollout_id_from_record({"_ng_rollout_id": "x", "_ng_attempt_index": [1]})


def test_clear_deletes_those_rollouts_in_every_directory_and_keeps_the_others(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for directory in dirs:
        rollouts = ("1-0", "1-0-a2", "x", "keep", "1-1")
        store = write(directory, [entry("c1", [1], [2], rollout_id=rid) for rid in rollouts])
        store.mark_incomplete_now("x", "c9")
    records = [
        {"_ng_task_index": 1, "_ng_rollout_index": 0},
        {"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_attempt_index": 2},
        {"_ng_rollout_id": "x"},
        {"_ng_rollout_id": "never-captured"},
        {"no": "ids"},
    ]
    clear_token_captures_for_rollouts(records, dirs)
    for directory in dirs:
        assert TokenCaptureStore(directory).rollout_ids() == ["1-1", "keep"]
        for rid in ("1-0", "1-0-a2", "x"):
            assert not (directory / f"{rid}.tokens.jsonl").exists()
            assert not (directory / f"{rid}.tokens.state.json").exists()
            assert not (directory / f"{rid}.tokens.incomplete").exists()
        # The kept rollouts still build.
        for rid in ("keep", "1-1"):
            build = trajectories_for_rollout(rid, [directory])
            assert build["mask_sample"] is False and build["metrics"]["n_calls"] == 1


def test_clear_with_a_consumed_generator_and_no_directories(tmp_path):
    clear_token_captures_for_rollouts(iter([{"_ng_rollout_id": "x"}]), [])
    write(tmp_path, [entry("c1", [1], [2], rollout_id="x")])
    clear_token_captures_for_rollouts(iter([{"_ng_rollout_id": "x"}]), [tmp_path])
    assert TokenCaptureStore(tmp_path).rollout_ids() == []
    # A cleared id can be captured and built again.
    write(tmp_path, [entry("c1", [1], [2], rollout_id="x")])
    assert trajectories_for_rollout("x", [tmp_path])["mask_sample"] is False


def test_clear_refuses_an_invalid_explicit_id_before_deleting_anything(tmp_path):
    write(tmp_path, [entry("c1", [1], [2], rollout_id="x")])
    with pytest.raises(ValueError):
        clear_token_captures_for_rollouts([{"_ng_rollout_id": "x"}, {"_ng_rollout_id": "bad id"}], [tmp_path])
    assert TokenCaptureStore(tmp_path).rollout_ids() == ["x"]


# -- no Ray in the core ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_core_imports_without_ray():
    code = (
        "import sys, raycap, raycap.capture.consumer, raycap.rows.arrow, raycap.capture.store, raycap.builders, raycap.capture.records\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_loading_an_entry_on_first_use_runs_no_collector_pass_over_the_process():
    # A process holding many objects (a Ray driver, a trainer) would otherwise have the
    # cyclic collector walk them all while the finalize modules load on first use. The
    # passes counted are those that start while the module is still being loaded.
    code = (
        "import gc, json, sys\n"
        "held = [[i] for i in range(300_000)]\n"
        "import raycap\n"
        "during = []\n"
        "def loading():\n"
        "    module = sys.modules.get('raycap.runs.rollouts')\n"
        "    return module is not None and getattr(module.__spec__, '_initializing', False)\n"
        "gc.callbacks.append(lambda phase, info: during.append(info['generation']) if phase == 'start' and loading() else None)\n"
        "raycap.finalize_rollouts\n"
        "missing = hasattr(raycap, 'no_such_entry')\n"
        "print(json.dumps([during, 'raycap.runs.rollouts' in sys.modules, missing, gc.isenabled()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    during, imported, missing, collecting = json.loads(out.stdout)
    assert imported and not missing
    assert during == [], f"collector passes (their generations) while the finalize modules loaded: {during}"
    assert collecting, "the collector stays paused after a lazy load"


# --- NeMo Gym's error texts, in builds and records ---------------------------------------------------
# Records are training data, aggregated by their error text, so a retired rollout and a corrupt
# capture line read exactly as in NeMo Gym (`Token capture for rollout X is retired`; the JSON
# parser's own message), with no machine path in them: where the bad line is goes to the log
# line that names the rollout. The store, delivery, finalize and Ray tests use these too.


RETIRED = "RuntimeError: Token capture for rollout {} is retired"
BAD_LINE = b"garbage"
# Exactly what orjson says of that line: Gym's store parses capture lines with orjson.
CORRUPT = "JSONDecodeError: unexpected character, expected a JSON value: line 1 column 1 (char 0)"


def _retired(store: TokenCaptureStore, rollout_id: str) -> None:
    _append_rollout(store, rollout_id)
    snapshot = store.freeze_now(rollout_id)
    assert store.drop_now(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)


def _corrupt(store: TokenCaptureStore, rollout_id: str) -> None:
    """A capture with a bad line in the middle: corruption, not a torn final write."""
    _append_rollout(store, rollout_id, calls=1)
    path = store.paths(rollout_id).jsonl
    good = path.read_bytes()
    with path.open("ab") as handle:
        handle.write(BAD_LINE + b"\n" + good)


def _record(task: int) -> dict:
    return {"_ng_task_index": task, "_ng_rollout_index": 0, "reward": 1.0,
            "response": {"id": "r", "model": "policy", "output": [], "usage": {}}}


@pytest.fixture
def store(tmp_path):
    return TokenCaptureStore(tmp_path / "captures")


def test_freezing_a_retired_rollout_raises_gyms_exact_text(store):
    _retired(store, "r1")
    with pytest.raises(RuntimeError) as info:
        store.freeze_now("r1")
    assert str(info.value) == "Token capture for rollout r1 is retired"
    # A writer of the consumed attempt gets the same words first, then the way out.
    with pytest.raises(RuntimeError, match=r"^Token capture for rollout r1 is retired: .*fresh rollout id"):
        _append_rollout(store, "r1")


def test_a_line_damaged_after_it_was_indexed_reads_the_same_as_one_in_the_tail(store):
    _append_rollout(store, "indexed", calls=2)
    path = store.paths("indexed").jsonl
    first, second = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(BAD_LINE + b"\n" + second)
    state = json.loads(store.paths("indexed").state.read_bytes())
    state["indexed_size"] = path.stat().st_size  # the index covers the damaged line
    store.paths("indexed").state.write_text(json.dumps(state))
    _corrupt(store, "tail")
    builds = [consumer.trajectories_for_rollout(rid, [store.root]) for rid in ("indexed", "tail")]
    assert [b["error"] for b in builds] == [CORRUPT, CORRUPT]


@pytest.mark.parametrize("case, error", [(_retired, RETIRED.format("r1")), (_corrupt, CORRUPT)])
def test_consumer_builds_carry_gyms_texts_and_no_paths(store, tmp_path, case, error):
    case(store, "r1")
    local = consumer.trajectories_for_rollout("r1", [store.root])
    from_source = asyncio.run(consumer.trajectories_from_source("r1", store))
    for build in (local, from_source):
        assert build["error"] == error and build["mask_sample"] is True
        assert str(tmp_path) not in json.dumps(build)


def test_a_newer_schema_is_refused_in_words_that_name_no_implementation(store):
    _append_rollout(store, "r1", calls=1)
    path = store.paths("r1").jsonl
    line = json.loads(path.read_bytes())
    line["model_call_id"], line["schema_version"] = "next", 2
    with path.open("a") as handle:
        handle.write(json.dumps(line, sort_keys=True) + "\n")
    error = consumer.trajectories_for_rollout("r1", [store.root])["error"]
    assert error.startswith("ValidationError: ") and "understands up to 1" in error
    assert "raycap" not in error
