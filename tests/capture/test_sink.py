"""raycap.capture.sink, as NeMo Gym's `token_id_capture.sink` (SPEC 10.2): a model server's
request under a capture context. No Ray here.

Each test plays a model server: it sets the request's `CaptureContext`, announces the
call, serves a response (a Responses or Chat Completions payload, a dict or a pydantic
model) and captures it; then it checks what reached the sink, what was marked
incomplete and what was logged, by the phrases operators search for.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from pydantic import BaseModel, ConfigDict

from gym_alias import nemo_gym_alias  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("nemo_gym_alias")

PROMPT, GENERATION, LOG_PROBS = [1, 2, 3], [10, 11], [-0.25, -0.5]


class RecordingSink:
    """A TokenSink (with begin_call) that records every call; `fail` names methods that raise."""

    def __init__(self, *, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    async def _record(self, name: str, *args) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise OSError(f"{name} failed")

    async def put(self, entry) -> None:
        await self._record("put", entry)

    async def mark_incomplete(self, rollout_id, model_call_id="") -> None:
        await self._record("mark_incomplete", rollout_id, model_call_id)

    async def begin_call(self, rollout_id, model_call_id) -> None:
        await self._record("begin_call", rollout_id, model_call_id)

    async def close(self) -> None: ...

    def named(self, name: str) -> list[tuple]:
        return [call[1:] for call in self.calls if call[0] == name]


class PutOnlySink:
    """A sink written before mark_incomplete existed."""

    def __init__(self) -> None:
        self.entries = []

    async def put(self, entry) -> None:
        self.entries.append(entry)

    async def close(self) -> None: ...


def responses_payload(**extra) -> dict:
    return {
        "id": "resp-1",
        "model": "served-model",
        "object": "response",
        "output": [
            {"type": "reasoning", "id": "rs-1", "summary": []},
            {"type": "message", "id": "msg-1", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}],
             "prompt_token_ids": PROMPT, "generation_token_ids": GENERATION, "generation_log_probs": LOG_PROBS, **extra},
        ],
    }


def chat_payload() -> dict:
    return {
        "id": "chatcmpl-1",
        "model": "served-model",
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": "hi", "prompt_token_ids": PROMPT, "generation_token_ids": GENERATION,
            "generation_log_probs": LOG_PROBS,
        }}],
    }


class ServedItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    role: str = "assistant"


class ServedResponse(BaseModel):
    """A server's pydantic response model, token fields as extras of its items."""

    model_config = ConfigDict(extra="allow")
    id: str
    model: str
    output: list[ServedItem]


def serve(sink, response, *, rollout_id="t0-r0", call_id="c1", model="", entry=None):
    """One request as a model server handles it; returns (context after the request, context after reset)."""
    from nemo_gym.token_id_capture.sink import (
        CaptureContext,
        capture_tokens,
        commit_entry,
        current_capture_context,
        register_call_intent,
        reset_token_sink,
        set_token_sink,
    )

    async def request():
        context = CaptureContext(rollout_id=rollout_id, model_call_id=call_id, token_sink=sink, model=model)
        token = set_token_sink(context)
        try:
            assert current_capture_context() is context
            await register_call_intent()
            if entry is not None:
                await commit_entry(entry)
            else:
                await capture_tokens(response)
        finally:
            reset_token_sink(token)
        return context, current_capture_context()

    return asyncio.run(request())


def warnings_with(caplog, phrase: str, level=logging.WARNING) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level and phrase in r.getMessage()]


# -- a captured call ---------------------------------------------------------------------------------


def test_a_responses_payload_becomes_the_calls_entry_with_the_arrays_on_its_carrier():
    sink = RecordingSink()
    before = time.time()
    context, after = serve(sink, responses_payload(routed_experts=[[0, 1], [1, 0]]))

    assert after is None and context.committed is True
    assert sink.named("begin_call") == [("t0-r0", "c1")]
    [(entry,)] = sink.named("put")
    assert (entry.rollout_id, entry.model_call_id, entry.model) == ("t0-r0", "c1", "served-model")
    assert (entry.prompt_token_ids, entry.generation_token_ids, entry.generation_log_probs) == (PROMPT, GENERATION, LOG_PROBS)
    assert entry.routed_experts == [[0, 1], [1, 0]]
    assert entry.output_items == [
        {"type": "reasoning", "id": "rs-1", "summary": []},
        {"type": "message", "id": "msg-1", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
    ]
    assert entry.token_item_index == 1
    assert before <= entry.created_at <= time.time()
    assert sink.named("mark_incomplete") == []


def test_a_chat_completions_payload_becomes_one_message_item():
    sink = RecordingSink()
    context, _ = serve(sink, chat_payload(), model="policy-v3")
    [(entry,)] = sink.named("put")
    assert entry.model == "policy-v3"  # the context's model wins over the payload's
    assert entry.output_items == [{"role": "assistant", "content": "hi", "type": "message"}]
    assert entry.token_item_index == 0 and entry.routed_experts is None
    assert context.committed


def test_a_pydantic_response_is_captured_from_its_dump():
    payload = responses_payload()
    response = ServedResponse(id="resp-1", model="served-model", output=[ServedItem(**item) for item in payload["output"]])
    sink = RecordingSink()
    context, _ = serve(sink, response)
    [(entry,)] = sink.named("put")
    assert entry.generation_token_ids == GENERATION and entry.token_item_index == 1
    assert entry.output_items[1]["content"] == [{"type": "output_text", "text": "hi"}]
    assert context.committed


def test_a_model_server_writing_into_the_store_gives_the_consumer_its_trajectory(tmp_path):
    from nemo_gym.token_id_capture import trajectories_for_rollout
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    store = TokenCaptureStore(tmp_path)
    serve(store, responses_payload(), call_id="c1")
    second = responses_payload()
    second["output"][1].update(prompt_token_ids=PROMPT + GENERATION + [7], generation_token_ids=[12], generation_log_probs=[-1.0])
    serve(store, second, call_id="c2")
    built = trajectories_for_rollout("t0-r0", [tmp_path])
    assert built["mask_sample"] is False and built["metrics"]["n_calls"] == 2
    output = built["rebuilt_response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "reasoning", "message"]
    assert output[3]["prompt_token_ids"] == PROMPT + GENERATION + [7] and output[3]["generation_token_ids"] == [12]
    assert "prompt_token_ids" not in output[0]


# -- what marks a rollout incomplete, and what does nothing ---------------------------------------------


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ({"id": "r", "output": [{"type": "message", "content": "no ids"}]}, "the response carries no token ids"),
        ({"choices": [{"message": {"role": "assistant", "content": "no ids"}}]}, "the response carries no token ids"),
        ("a plain string", "the response is a str"),
        (None, "the response is a NoneType"),
    ],
)
def test_a_response_without_token_ids_marks_the_rollout_incomplete(caplog, response, reason):
    sink = RecordingSink()
    with caplog.at_level(logging.WARNING):
        context, _ = serve(sink, response)
    assert sink.named("put") == [] and sink.named("mark_incomplete") == [("t0-r0", "c1")]
    [record] = warnings_with(caplog, "Training-token capture has no token ids")
    assert record.getMessage().endswith(": " + reason)
    assert context.committed is False


def test_a_missing_capture_after_a_commit_or_without_a_sink_does_nothing(caplog):
    from nemo_gym.token_id_capture.records import TokenEntry
    from nemo_gym.token_id_capture.sink import (
        CaptureContext,
        capture_tokens,
        commit_entry,
        reset_token_sink,
        set_token_sink,
    )

    sink = RecordingSink()

    async def committed_then_missing():
        token = set_token_sink(CaptureContext("t0-r0", "c1", sink))
        entry = TokenEntry(rollout_id="t0-r0", model_call_id="c1", prompt_token_ids=PROMPT,
                           generation_token_ids=GENERATION, generation_log_probs=LOG_PROBS)
        await commit_entry(entry)
        await capture_tokens({"output": []})  # e.g. a streamed tail without ids
        reset_token_sink(token)

    with caplog.at_level(logging.WARNING):
        asyncio.run(committed_then_missing())
        context, _ = serve(None, {"output": []})
    assert [call[0] for call in sink.calls] == ["put"]
    assert caplog.records == []
    assert context.committed is False


def test_without_a_sink_a_good_response_counts_as_committed_and_nothing_is_written(caplog):
    with caplog.at_level(logging.WARNING):
        context, _ = serve(None, responses_payload())
    assert context.committed is True and caplog.records == []


def test_a_sink_without_mark_incomplete_is_an_error_naming_the_sink(caplog):
    sink = PutOnlySink()
    with caplog.at_level(logging.WARNING):
        serve(sink, {"output": [{"type": "message"}]})
    [record] = warnings_with(caplog, "does not implement mark_incomplete", level=logging.ERROR)
    assert record.getMessage().startswith("Sink PutOnlySink does not implement mark_incomplete.")
    assert sink.entries == []


def test_a_sink_whose_put_raises_marks_the_rollout_and_logs_the_traceback(caplog):
    sink = RecordingSink(fail=("put",))
    with caplog.at_level(logging.WARNING):
        context, _ = serve(sink, responses_payload())
    [record] = warnings_with(caplog, "Training-token capture failed to write the record")
    assert record.exc_info is not None and "put failed" in caplog.text
    assert sink.named("mark_incomplete") == [("t0-r0", "c1")]
    assert context.committed is False


def test_a_response_whose_entry_cannot_be_built_marks_the_rollout(caplog):
    twice = responses_payload()
    twice["output"][0].update(prompt_token_ids=[1], generation_token_ids=[2], generation_log_probs=[-1.0])
    mismatched = responses_payload()
    mismatched["output"][1]["generation_log_probs"] = [-1.0]  # one log prob for two ids
    for response in (twice, mismatched):
        sink = RecordingSink()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            serve(sink, response)
        assert len(warnings_with(caplog, "Training-token capture failed to build the record")) == 1
        assert sink.named("put") == [] and sink.named("mark_incomplete") == [("t0-r0", "c1")]


def test_a_failed_build_without_a_sink_still_tries_to_mark_and_says_it_cannot(caplog):
    twice = responses_payload()
    twice["output"][0].update(prompt_token_ids=[1], generation_token_ids=[2], generation_log_probs=[-1.0])
    with caplog.at_level(logging.WARNING):
        serve(None, twice)
    assert len(warnings_with(caplog, "failed to build the record")) == 1
    assert warnings_with(caplog, "Sink NoneType does not implement mark_incomplete.", level=logging.ERROR)


def test_a_mark_that_raises_is_logged_and_never_fails_the_request(caplog):
    sink = RecordingSink(fail=("mark_incomplete",))
    with caplog.at_level(logging.WARNING):
        serve(sink, {"output": []})
    [record] = warnings_with(caplog, "Could not mark rollout t0-r0 incomplete.")
    assert record.exc_info is not None


def test_an_entry_for_another_call_is_not_written_and_marks_the_contexts_call(caplog):
    from nemo_gym.token_id_capture.records import TokenEntry

    sink = RecordingSink()
    stray = TokenEntry(rollout_id="t0-r0", model_call_id="c2", prompt_token_ids=PROMPT,
                       generation_token_ids=GENERATION, generation_log_probs=LOG_PROBS)
    with caplog.at_level(logging.WARNING):
        context, _ = serve(sink, None, entry=stray)
    assert warnings_with(caplog, "Training-token capture identity mismatch")
    assert sink.named("put") == [] and sink.named("mark_incomplete") == [("t0-r0", "c1")]
    assert context.committed is False


# -- without a context, and announcing calls --------------------------------------------------------


def test_without_a_context_nothing_is_captured_announced_or_marked(caplog):
    from nemo_gym.token_id_capture.records import TokenEntry
    from nemo_gym.token_id_capture.sink import (
        capture_tokens,
        commit_entry,
        current_capture_context,
        register_call_intent,
    )

    entry = TokenEntry(rollout_id="t0-r0", model_call_id="c1", prompt_token_ids=PROMPT,
                       generation_token_ids=GENERATION, generation_log_probs=LOG_PROBS)

    async def outside_a_request():
        assert current_capture_context() is None
        await register_call_intent()
        await capture_tokens(responses_payload())
        await capture_tokens("not even a response")
        await commit_entry(entry)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(outside_a_request())
    assert [r for r in caplog.records if r.name.startswith("raycap")] == []


def test_register_call_intent_needs_begin_call_and_lets_its_errors_through():
    from nemo_gym.token_id_capture.sink import CaptureContext, register_call_intent, reset_token_sink, set_token_sink

    async def announce(sink):
        token = set_token_sink(CaptureContext("t0-r0", "c1", sink))
        try:
            await register_call_intent()
        finally:
            reset_token_sink(token)

    asyncio.run(announce(PutOnlySink()))  # no begin_call: nothing to announce
    asyncio.run(announce(None))
    with pytest.raises(OSError, match="begin_call failed"):
        asyncio.run(announce(RecordingSink(fail=("begin_call",))))


def test_concurrent_requests_on_one_loop_each_capture_into_their_own_context():
    sink = RecordingSink()

    async def both():
        from nemo_gym.token_id_capture.sink import CaptureContext, capture_tokens, reset_token_sink, set_token_sink

        async def request(call_id, delay):
            token = set_token_sink(CaptureContext("t0-r0", call_id, sink))
            await asyncio.sleep(delay)  # the other request sets its context meanwhile
            await capture_tokens(responses_payload())
            reset_token_sink(token)

        await asyncio.gather(request("c1", 0.02), request("c2", 0.0))

    asyncio.run(both())
    assert sorted(entry.model_call_id for (entry,) in sink.named("put")) == ["c1", "c2"]
