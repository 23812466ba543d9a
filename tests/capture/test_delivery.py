"""raycap.capture.delivery, as NeMo Gym's `token_id_capture.delivery` (SPEC 10.4 and 10.5): the
finalizer a rollout collection calls on every finished record, and retirement. No Ray.

Most tests finalize against a real capture directory (`TokenCaptureStore` is a
TokenSource); the branches where the source or the build raises use small fakes. Each
test checks exactly what the record holds afterwards and what the call returned.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import warnings

import pytest

from collection import _append_rollout
from gym_alias import nemo_gym_alias  # noqa: F401 - the fixture
from raycap.capture import delivery
from test_consumer import CORRUPT, RETIRED, _corrupt, _record, _retired

pytestmark = pytest.mark.usefixtures("nemo_gym_alias")

SERVED = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "served"}]}


def entry(rollout_id, call_id, prompt, generation, created_at=0.0):
    from nemo_gym.token_id_capture.records import TokenEntry

    return TokenEntry(rollout_id=rollout_id, model_call_id=call_id, prompt_token_ids=prompt, generation_token_ids=generation,
                      generation_log_probs=[-0.5] * len(generation), created_at=created_at,
                      output_items=[dict(SERVED)], token_item_index=0)


def captured(store, rollout_id, *, roots=1):
    """A two-turn capture; roots=2 adds an unrelated call (a second root: masked)."""
    store.append(entry(rollout_id, "c1", [1, 2, 3], [10, 11]))
    store.append(entry(rollout_id, "c2", [1, 2, 3, 10, 11, 4], [12]))
    if roots == 2:
        store.append(entry(rollout_id, "side", [90], [91], created_at=5.0))


def record(task=0, rollout=0, **extra):
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "reward": 1.0,
        "response": {"id": "resp-9", "model": "policy", "output": [SERVED], "usage": {"input_tokens": 0}},
        **extra,
    }


def finalize(result, source):
    from nemo_gym.token_id_capture.delivery import finalize_rollout_token_capture

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = asyncio.run(finalize_rollout_token_capture(result, source))
    return built, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.fixture
def store(tmp_path):
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    return TokenCaptureStore(tmp_path / "captures")


class FakeSource:
    """A TokenSource whose freeze and drop return or raise what the test sets."""

    def __init__(self, *, freeze=None, drop=True):
        self.freeze_outcome, self.drop_outcome, self.calls = freeze, drop, []

    async def freeze(self, rollout_id):
        self.calls.append(("freeze", rollout_id))
        if isinstance(self.freeze_outcome, Exception):
            raise self.freeze_outcome
        return self.freeze_outcome

    async def drop(self, rollout_id, *, snapshot_id, version):
        self.calls.append(("drop", rollout_id, snapshot_id, version))
        if isinstance(self.drop_outcome, Exception):
            raise self.drop_outcome
        return self.drop_outcome

    async def close(self):
        return None


# -- the branches of finalize_rollout_token_capture, in order -------------------------------------------


def test_1_without_a_source_nothing_happens():
    result = record()
    before = copy.deepcopy(result)
    assert finalize(result, None) == (None, [])
    assert result == before


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        ({"_ng_rollout_id": "has space"}, "malformed rollout id: _ng_rollout_id must be a string of letters"),
        ({"_ng_rollout_id": 7}, "malformed rollout id: _ng_rollout_id must be a string of letters"),
        ({"_ng_attempt_index": "second"}, "malformed rollout id: invalid literal for int()"),
        ({"_ng_attempt_index": [1]}, "malformed rollout id: int() argument must be"),
    ],
)
def test_2_a_malformed_rollout_id_masks_the_record(store, ids, error):
    from nemo_gym.token_id_capture.delivery import MASK_SAMPLE_KEY, TOKEN_CAPTURE_KEY

    result = record(**ids)
    response = copy.deepcopy(result["response"])
    built, warned = finalize(result, store)
    assert built["error"].startswith(error)
    assert built == {"rebuilt_response": None, "mask_sample": True, "error": built["error"],
                     "metrics": {"n_calls": 0, "error": built["error"]}}
    assert result[MASK_SAMPLE_KEY] is True
    assert result[TOKEN_CAPTURE_KEY] == {"n_calls": 0, "error": built["error"]}
    assert result["response"] == response
    assert len(warned) == 1 and built["error"] in warned[0]


def _inline_record(**ids):
    result = record(**ids)
    result["response"]["output"] = [{**SERVED, "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.1]}]
    return result


def test_3_a_record_with_inline_token_ids_keeps_its_response_and_reports_its_capture_as_redundant(store):
    from nemo_gym.token_id_capture.delivery import capture_build_can_retire, retire_rollout_token_capture

    captured(store, "0-0")
    result = _inline_record()
    before = copy.deepcopy(result)
    built, warned = finalize(result, store)
    snapshot = store.freeze_now("0-0")
    assert built == {"rebuilt_response": None, "mask_sample": False, "_redundant_capture": True,
                     "_capture_snapshot": {"snapshot_id": snapshot.snapshot_id, "version": snapshot.version}}
    assert result == before and warned == []
    assert capture_build_can_retire(built)
    assert asyncio.run(retire_rollout_token_capture("0-0", store, built)) is True
    assert store.lifecycle("0-0").retired


def test_3_a_record_with_inline_token_ids_and_no_rollout_id_is_left_alone():
    source = FakeSource()
    result = _inline_record(_ng_task_index=None)
    before = copy.deepcopy(result)
    assert finalize(result, source) == (None, [])
    assert result == before and source.calls == []


def test_3_a_redundant_capture_that_cannot_be_frozen_is_a_warning_and_nothing_else():
    result = _inline_record()
    before = copy.deepcopy(result)
    built, warned = finalize(result, FakeSource(freeze=RuntimeError("the node is gone")))
    assert built is None and result == before
    assert len(warned) == 1 and "the node is gone" in warned[0]


def test_4_a_record_without_a_rollout_id_is_masked_for_lack_of_a_capture_key(store):
    result = record(_ng_rollout_index=None)
    built, warned = finalize(result, store)
    assert built["error"] == "no capture key" and built["mask_sample"] is True
    assert result["mask_sample"] is True and result["_ng_token_capture"] == {"n_calls": 0, "error": "no capture key"}
    assert result["response"]["output"] == [SERVED]
    assert len(warned) == 1


@pytest.mark.parametrize("patched", ["delivery", "consumer"])
def test_5_a_build_that_raises_or_finds_nothing_masks_the_record(store, monkeypatch, patched):
    import importlib

    # A wrapper of the build may replace it in either module.
    module = importlib.import_module(f"nemo_gym.token_id_capture.{patched}")

    async def raises(rollout_id, source, **kwargs):
        raise KeyError("prompt_token_ids")

    async def nothing(rollout_id, source, **kwargs):
        return None

    monkeypatch.setattr(module, "trajectories_from_source", raises)
    result = record()
    built, warned = finalize(result, store)
    assert built["error"] == "KeyError: 'prompt_token_ids'" and result["mask_sample"] is True
    assert result["_ng_token_capture"] == {"n_calls": 0, "error": "KeyError: 'prompt_token_ids'"} and len(warned) == 1

    monkeypatch.setattr(module, "trajectories_from_source", nothing)
    result = record()
    built, _ = finalize(result, store)
    assert built["error"] == "nothing recorded" and result["_ng_token_capture"]["error"] == "nothing recorded"


def test_6_7_an_unmasked_build_replaces_only_the_output_and_writes_its_metrics(store):
    captured(store, "3-1")
    result = record(task=3, rollout=1)
    built, warned = finalize(result, store)

    assert built["mask_sample"] is False and warned == []
    assert result["response"]["output"] == built["rebuilt_response"]["output"]
    assert result["response"]["output"][-1]["generation_token_ids"] == [12]
    assert (result["response"]["id"], result["response"]["usage"]) == ("resp-9", {"input_tokens": 0})  # the rest is the record's
    assert built["rebuilt_response"]["model"] == "policy"  # the response's model names the projection
    assert result["_ng_token_capture"] == built["metrics"] and result["_ng_token_capture"] is not built["metrics"]
    assert "error" not in result["_ng_token_capture"]
    assert "mask_sample" not in result  # an unmasked build writes no mask
    assert built["_capture_snapshot"]["snapshot_id"] == store.freeze_now("3-1").snapshot_id


def test_6_7_a_masked_build_with_a_response_still_replaces_the_output_and_masks_the_record(store):
    captured(store, "0-0", roots=2)
    result = record()
    built, warned = finalize(result, store)
    assert built["mask_sample"] is True and built["rebuilt_response"] is not None
    assert result["response"]["output"] == built["rebuilt_response"]["output"]
    assert result["mask_sample"] is True and result["_ng_token_capture"]["roots"] == 2
    assert "error" not in result["_ng_token_capture"]
    assert len(warned) == 1 and "0-0" in warned[0]


def test_6_7_a_failed_build_keeps_the_served_response_and_records_the_error(store):
    store.begin_call_now("0-0", "c1")  # announced, never captured
    result = record()
    built, warned = finalize(result, store)
    assert built["error"] == "capture contains no token records"
    assert result["response"]["output"] == [SERVED]
    assert result["_ng_token_capture"] == {"n_calls": 0, "capture_incomplete": True, "error": "capture contains no token records"}
    assert result["mask_sample"] is True and len(warned) == 1


def test_6_7_an_incomplete_capture_is_built_but_masked(store):
    captured(store, "0-0")
    store.mark_incomplete_now("0-0", "c3")
    result = record()
    built, _ = finalize(result, store)
    assert built["rebuilt_response"] is not None and result["response"]["output"] == built["rebuilt_response"]["output"]
    assert result["mask_sample"] is True and result["_ng_token_capture"]["capture_incomplete"] is True


@pytest.mark.parametrize("response", [None, "served text", ["not", "a", "dict"]])
def test_6_a_response_that_is_not_a_dict_is_replaced_whole(store, response):
    captured(store, "0-0")
    result = record(response=response)
    built, _ = finalize(result, store)
    assert result["response"] == built["rebuilt_response"] and built["rebuilt_response"]["model"] == ""


def test_an_explicit_rollout_id_and_attempt_name_the_capture(store):
    captured(store, "run-7.b-a2")
    result = record(_ng_rollout_id="run-7.b", _ng_attempt_index=2)
    built, _ = finalize(result, store)
    assert built["mask_sample"] is False and built["rollout_id"] == "run-7.b-a2"


# -- retiring -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("built", "allowed"),
    [
        (None, False),
        ({"mask_sample": True, "rebuilt_response": {"output": []}}, False),
        ({"mask_sample": True, "_redundant_capture": True}, False),
        ({"mask_sample": False, "rebuilt_response": None}, False),
        ({"mask_sample": False, "rebuilt_response": None, "_redundant_capture": False}, False),
        ({"mask_sample": False, "rebuilt_response": {"output": []}}, True),
        ({"rebuilt_response": {"output": []}}, True),
        ({"mask_sample": False, "rebuilt_response": None, "_redundant_capture": True}, True),
    ],
)
def test_capture_build_can_retire_only_unmasked_rebuilt_or_redundant_builds(built, allowed):
    from nemo_gym.token_id_capture.delivery import capture_build_can_retire

    assert capture_build_can_retire(built) is allowed


def test_retire_drops_exactly_the_consumed_snapshot_and_never_a_masked_one(store):
    from nemo_gym.token_id_capture.delivery import retire_rollout_token_capture

    captured(store, "0-0")
    captured(store, "0-1", roots=2)
    good, masked = record(), record(rollout=1)
    built_good, _ = finalize(good, store)
    built_masked, _ = finalize(masked, store)
    assert asyncio.run(retire_rollout_token_capture("0-1", store, built_masked)) is False
    assert not store.lifecycle("0-1").retired  # kept as evidence
    assert asyncio.run(retire_rollout_token_capture("0-0", None, built_good)) is False
    assert asyncio.run(retire_rollout_token_capture("0-0", store, built_good)) is True
    assert store.lifecycle("0-0").retired
    assert asyncio.run(retire_rollout_token_capture("0-0", store, built_good)) is True  # the same snapshot: harmless


def test_retire_converts_the_snapshot_identity_and_survives_every_failure():
    from nemo_gym.token_id_capture.delivery import retire_rollout_token_capture

    built = {"mask_sample": False, "rebuilt_response": {"output": []}, "_capture_snapshot": {"snapshot_id": 12, "version": "3"}}
    source = FakeSource(drop=True)
    assert asyncio.run(retire_rollout_token_capture("r", source, built)) is True
    assert source.calls == [("drop", "r", "12", 3)]

    def retire(source, built):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            retired = asyncio.run(retire_rollout_token_capture("r", source, built))
        return retired, len(caught)

    assert retire(FakeSource(drop=False), built) == (False, 0)  # the capture changed since: kept
    assert retire(FakeSource(drop=OSError("disk")), built) == (False, 1)
    assert retire(FakeSource(), {**built, "_capture_snapshot": None}) == (False, 1)
    assert retire(FakeSource(), {**built, "_capture_snapshot": {"version": 3}}) == (False, 1)


def test_rollout_carries_token_ids():
    from nemo_gym.token_id_capture.delivery import rollout_carries_token_ids

    assert rollout_carries_token_ids(_inline_record()) is True
    assert rollout_carries_token_ids(record()) is False
    assert rollout_carries_token_ids({"response": {"output": [{"generation_token_ids": []}, "x"]}}) is False
    assert rollout_carries_token_ids({"response": {"output": "x"}}) is False
    assert rollout_carries_token_ids({"response": "text"}) is False
    assert rollout_carries_token_ids({}) is False


# -- a collection loop, as NeMo Gym's uses delivery (SPEC 10.6) ------------------------------------------


def test_a_collection_loop_writes_records_durably_and_retires_only_what_it_may(store, tmp_path):
    from nemo_gym.token_id_capture.delivery import (
        capture_build_can_retire,
        finalize_rollout_token_capture,
        maybe_rollout_id_from_run_body,
        retire_rollout_token_capture,
    )

    captured(store, "0-0")
    captured(store, "0-1", roots=2)
    captured(store, "1-0")
    rows = [record(0, 0), record(0, 1), _inline_record(_ng_task_index=1, _ng_rollout_index=0), record(2, 0)]
    results = tmp_path / "results.jsonl"

    async def collect():
        retired = []
        with open(results, "w") as handle, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for row in rows:
                built = await finalize_rollout_token_capture(row, store)
                handle.write(json.dumps(row) + "\n")
                handle.flush()
                rollout_id = maybe_rollout_id_from_run_body(row)
                if rollout_id and capture_build_can_retire(built):
                    os.fsync(handle.fileno())
                    retired.append((rollout_id, await retire_rollout_token_capture(rollout_id, store, built)))
        return retired

    assert asyncio.run(collect()) == [("0-0", True), ("1-0", True)]
    written = [json.loads(line) for line in results.read_text().splitlines()]
    assert [row.get("mask_sample", False) for row in written] == [False, True, False, True]
    assert written[3]["_ng_token_capture"]["error"] == "capture contains no token records"
    assert [store.lifecycle(r).retired for r in ("0-0", "0-1", "1-0")] == [True, False, True]


# --- NeMo Gym's texts in the record, and delivery's warnings in Gym's phrases ------------------------


@pytest.mark.parametrize("case, error", [(_retired, RETIRED.format("0-0")), (_corrupt, CORRUPT)])
def test_delivery_writes_gyms_texts_into_the_record(store, tmp_path, case, error):
    case(store, "0-0")
    result = _record(0)
    with pytest.warns(UserWarning, match="marked for masking"):
        built = asyncio.run(delivery.finalize_rollout_token_capture(result, store))
    assert built["error"] == error
    assert result["_ng_token_capture"]["error"] == error and result["mask_sample"] is True
    assert str(tmp_path) not in json.dumps(result)


def test_a_masked_build_warns_that_the_rollout_is_marked_for_masking(store):
    _append_rollout(store, "0-0")
    store.mark_incomplete_now("0-0", "lost")
    with pytest.warns(UserWarning, match=r"Token capture of rollout 0-0 is marked for masking: .*incomplete"):
        built = asyncio.run(delivery.finalize_rollout_token_capture(_record(0), store))
    assert built["mask_sample"] is True


def test_a_record_without_an_id_warns_that_it_carries_no_id(store):
    result = {"reward": 1.0, "response": {"output": []}}
    with pytest.warns(UserWarning, match="carries no id") as caught:
        built = asyncio.run(delivery.finalize_rollout_token_capture(result, store))
    assert "marked for masking" in str(caught[0].message)
    assert built["error"] == "no capture key" and result["_ng_token_capture"] == {"n_calls": 0, "error": "no capture key"}
