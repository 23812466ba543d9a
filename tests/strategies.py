"""Hypothesis strategies for realistic token captures of one rollout.

A rollout is grown the way an agent grows one: a main conversation whose every call's
prompt is the previous prompt + generation + some tool or user ids, plus the things that
make rebuilding hard: retries anywhere (including of the first call), with or without a
continuation; sub-agent branches that extend an earlier call differently; compaction (a
fresh short prompt that later calls continue); side calls; empty generations; identical
calls (the same prompt and generation twice, so a continuation is ambiguous). Created-at
stamps are random with ties, output items come in every shape the records allow, and the
final list is shuffled because capture order means nothing.

A small token alphabet is drawn some of the time so unrelated calls match by accident.
"""

from __future__ import annotations

import os

from hypothesis import strategies as st

from raycap.capture.records import TokenEntry


def examples(n: int) -> int:
    """A property test's number of examples: all `n` in the full run (make test, CI), a
    quarter (at least 10) in the inner loop, which sets RAYCAP_TEST_EXAMPLES=quick."""
    return max(10, n // 4) if os.environ.get("RAYCAP_TEST_EXAMPLES") == "quick" else n


# A plain agent loop: every call continues the last one (empty generations happen).
_PLAIN_ACTIONS = ("continue", "continue", "continue", "continue", "empty")
_ACTIONS = (
    "continue",
    "continue",
    "continue",
    "continue",
    "retry",
    "retry_continue",
    "branch",
    "compaction",
    "side",
    "empty",
    "identical",
)

_ID_ALPHABET = "abAB09-_."


def _message(text: str) -> dict:
    return {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _reasoning() -> dict:
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]}


def _function_call(name: str) -> dict:
    return {"type": "function_call", "name": name, "arguments": "{}", "call_id": f"fc-{name}"}


@st.composite
def _output_items(draw, prompt: list[int], gen: list[int], log_probs: list[float], odd_items: bool):
    """(output_items, token_item_index) in one of the shapes records carry."""
    shapes = ["none", "message", "full", "full", "legacy"] * 3
    if odd_items:
        shapes += ["legacy_beside_index", "inline_null"]
    shape = draw(st.sampled_from(shapes))
    if shape == "none":
        return [], None
    if shape == "message":
        return [_message("hi")], draw(st.sampled_from([None, 0]))
    if shape == "full":
        parts = draw(st.lists(st.sampled_from(["reasoning", "function_call", "message"]), min_size=1, max_size=3))
        items = []
        for part in parts:
            if part == "reasoning":
                items.append(_reasoning())
            elif part == "function_call":
                items.append(_function_call(f"tool{len(items)}"))
            else:
                items.append(_message("done"))
        index = draw(st.one_of(st.none(), st.integers(0, len(items) - 1)))
        return items, index
    inline = {
        "type": "message",
        "role": "assistant",
        "content": [],
        "prompt_token_ids": list(prompt),
        "generation_token_ids": list(gen),
        "generation_log_probs": list(log_probs),
    }
    if shape == "legacy":
        # Older records: the arrays stayed on the item that carried them, no index.
        before = draw(st.booleans())
        return ([_reasoning(), inline] if before else [inline]), None
    if shape == "legacy_beside_index":
        # An inline item that is not the indexed carrier still counts as token-bearing.
        if draw(st.booleans()):
            del inline["prompt_token_ids"]
        return [inline, _message("x")], 1
    # An item whose generation_token_ids key is present but null carries nothing.
    return [_reasoning(), {"type": "message", "generation_token_ids": None}], None


@st.composite
def rollouts(
    draw,
    rollout_id: str = "rollout-0",
    min_calls: int = 1,
    max_calls: int = 12,
    odd_items: bool = True,
) -> list[TokenEntry]:
    """A shuffled list of TokenEntry for one rollout.

    Some rollouts are a plain agent loop, the others mix in every hard case. With
    `odd_items` (the default) some rollouts also carry rare item shapes that break the
    projection (an inline token item beside the indexed carrier, maybe without a prompt;
    an item whose inline generation is null); `odd_items=False` keeps output items to
    shapes whose projection is always prefix-contiguous.
    """
    small_alphabet = draw(st.booleans())
    actions = draw(st.sampled_from([_PLAIN_ACTIONS, _ACTIONS, _ACTIONS]))
    odd_items = odd_items and draw(st.booleans())
    token = st.integers(0, 2) if small_alphabet else st.integers(0, 50_000)

    def ids(min_size: int, max_size: int) -> list[int]:
        return draw(st.lists(token, min_size=min_size, max_size=max_size))

    target = draw(st.integers(min_calls, max_calls))
    if target == 0:
        return []

    # (prompt, generation) of every call, in the order the agent made them.
    calls: list[tuple[list[int], list[int]]] = []
    # Calls the agent may continue from (the heads of the main thread and of sub-agents).
    heads: list[int] = []

    def add(prompt: list[int], gen: list[int]) -> int:
        calls.append((prompt, gen))
        return len(calls) - 1

    def extend(call: int, min_extra: int) -> list[int]:
        prompt, gen = calls[call]
        return prompt + gen + ids(min_extra, 4)

    heads.append(add(ids(1, 6), ids(1, 5)))
    while len(calls) < target:
        action = draw(st.sampled_from(actions))
        thread = draw(st.integers(0, len(heads) - 1))
        head = heads[thread]
        earlier = draw(st.integers(0, len(calls) - 1))
        if action == "continue":
            heads[thread] = add(extend(head, 0), ids(1, 5))
        elif action == "retry":
            # The same prompt resampled; the agent went on with the earlier attempt.
            add(list(calls[earlier][0]), ids(1, 5))
        elif action == "retry_continue":
            # The same prompt resampled; the agent went on with this attempt.
            heads[thread] = add(list(calls[head][0]), ids(1, 5))
        elif action == "branch":
            heads.append(add(extend(earlier, 1), ids(1, 5)))
        elif action == "compaction":
            heads[thread] = add(ids(1, 4), ids(1, 5))
        elif action == "side":
            prompt = calls[earlier][0]
            shared = draw(st.integers(0, len(prompt)))
            add(prompt[:shared] + ids(0, 3), ids(1, 3))
        elif action == "empty":
            call = add(extend(head, 0), [])
            if draw(st.booleans()):
                heads[thread] = call
        else:  # identical: the same prompt and the same sample twice
            call = add(list(calls[earlier][0]), list(calls[earlier][1]))
            if draw(st.booleans()):
                heads.append(call)

    call_ids = draw(
        st.lists(
            st.text(alphabet=_ID_ALPHABET, min_size=1, max_size=4),
            min_size=len(calls),
            max_size=len(calls),
            unique=True,
        )
    )
    stamps = draw(st.sampled_from(["ordered", "ties", "random"]))
    with_experts = draw(st.booleans())

    entries = []
    for position, (prompt, gen) in enumerate(calls):
        if stamps == "ordered":
            created_at = float(position)
        elif stamps == "ties":
            created_at = draw(st.sampled_from([0.0, 1.0, 2.0]))
        else:
            created_at = draw(st.floats(0, 1000, allow_nan=False))
        log_probs = [draw(st.floats(-10, 0, allow_nan=False)) for _ in gen]
        items, index = draw(_output_items(prompt, gen, log_probs, odd_items))
        routed = None
        if with_experts and draw(st.booleans()):
            routed = [[t % 4, (t + 1) % 4] for t in gen]
        entries.append(
            TokenEntry(
                rollout_id=rollout_id,
                model_call_id=call_ids[position],
                model="policy",
                prompt_token_ids=prompt,
                generation_token_ids=gen,
                generation_log_probs=log_probs,
                routed_experts=routed,
                output_items=items,
                token_item_index=index,
                created_at=created_at,
            )
        )
    return list(draw(st.permutations(entries)))


def rollout_with_id(rollout_id: str, **kwargs) -> st.SearchStrategy[list[TokenEntry]]:
    """`rollouts()` whose entries all carry `rollout_id`."""
    return rollouts(rollout_id=rollout_id, **kwargs)
