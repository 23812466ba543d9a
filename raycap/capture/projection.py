"""Projection: one chain as Responses output items, and the checks of such items.

Every call's items are copied and the carrier item receives the running token sequence
before the generation, the generation and its log probs. `project_chain` does it through
the token arrays (`Projection`), `projection_items` makes the items from that.
`assert_prefix_contiguity` takes a response and walks its output;
`assert_items_contiguous` is the same check over a list of items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from raycap.capture.buildoutput import BuildOutput, Chain
from raycap.capture.records import CallArrays, TokenEntry


def _carries_tokens(item: Any) -> bool:
    return isinstance(item, dict) and item.get("generation_token_ids") is not None


def carrier_indices(entry: TokenEntry) -> tuple[int, ...]:
    """Which output items of a call receive its token arrays; () means a synthesized item."""
    items = entry.output_items
    index = entry.token_item_index
    if index is not None and 0 <= index < len(items):
        return (index,)
    inline = tuple(i for i, item in enumerate(items) if _carries_tokens(item))
    if inline:
        return inline  # older records kept the arrays on the item itself
    return (len(items) - 1,) if items else ()


@dataclass(frozen=True)
class ProjectedCall:
    """One call of a projected chain: its generation spans token_ids[gen_start:gen_end]."""

    model_call_id: str
    output_items: list[dict]
    routed_experts: Any
    gen_start: int
    gen_end: int
    carriers: tuple[int, ...]


@dataclass(frozen=True)
class Projection:
    """A chain as training-ready arrays plus what is needed to write its Responses items.

    token_ids is the full sequence of the chain; every carrier's prompt is a prefix of it,
    so the quadratic per-call prompt copies exist only when dicts are asked for."""

    token_ids: np.ndarray
    log_probs: np.ndarray  # captured values on generated positions, 0.0 elsewhere
    loss_mask: np.ndarray  # 1 on generated positions
    calls: list[ProjectedCall]


def project_chain(chain: Chain) -> Projection:
    root_prompt = chain.root_prompt_array
    parts: list[np.ndarray] = [root_prompt]
    spans: list[tuple[int, int]] = []
    size = len(root_prompt)
    gens = []
    for pos, link in enumerate(chain.links):
        if pos:
            interstitial = link.interstitial_array
            parts.append(interstitial)
            size += len(interstitial)
        arrays = link.arrays if link.arrays is not None else CallArrays.of(link.entry)
        gen, lp = arrays.generation, arrays.log_probs
        if len(lp) != len(gen):
            raise ValueError(
                f"call {link.entry.model_call_id} has {len(lp)} log probs for {len(gen)} generated ids"
            )
        parts.append(gen)
        gens.append(lp)
        spans.append((size, size + len(gen)))
        size += len(gen)
    token_ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    log_probs = np.zeros(len(token_ids), dtype=np.float64)
    loss_mask = np.zeros(len(token_ids), dtype=np.int8)
    calls = []
    for link, (start, end), lp in zip(chain.links, spans, gens):
        log_probs[start:end] = lp
        loss_mask[start:end] = 1
        entry = link.entry
        calls.append(
            ProjectedCall(entry.model_call_id, entry.output_items, entry.routed_experts, start, end, carrier_indices(entry))
        )
    return Projection(token_ids, log_probs, loss_mask, calls)


def projection_items(projection: Projection) -> list[dict]:
    """The Responses output items of a projected chain (copies; the carriers filled in)."""
    token_ids, log_probs = projection.token_ids, projection.log_probs
    out: list[dict] = []
    for call in projection.calls:
        fields = {
            "prompt_token_ids": token_ids[: call.gen_start].tolist(),
            "generation_token_ids": token_ids[call.gen_start : call.gen_end].tolist(),
            "generation_log_probs": log_probs[call.gen_start : call.gen_end].tolist(),
        }
        place_call_fields(call, fields, out)
    return out


def place_call_fields(call: Any, fields: dict[str, Any], out: list[dict]) -> None:
    """Append one projected call's output items to `out`, its token fields (and its
    routed experts) on its carriers, or as one message item when it has none."""
    if call.routed_experts is not None:
        fields["routed_experts"] = call.routed_experts
    if not call.carriers:
        out.append({"type": "message", **fields})
        return
    items = [dict(item) for item in call.output_items]
    first, *others = call.carriers
    items[first].update(fields)
    for index in others:  # older records with several inline carriers: each its own lists
        items[index].update({key: list(value) if isinstance(value, list) else value for key, value in fields.items()})
    out.extend(items)


def project_chain_to_output_items(chain: Chain) -> list[dict]:
    return projection_items(project_chain(chain))


def _token_bearing(items: list[dict]) -> list[dict]:
    return [item for item in items if _carries_tokens(item)]


def response_from_items(rollout_id: str, items: list[dict], model: str) -> dict:
    """Wrap projected items as one Responses payload (usage over token-bearing items)."""
    bearing = _token_bearing(items)
    if not any(item["generation_token_ids"] for item in bearing):
        raise ValueError("capture produced no trainable generated tokens")
    usage = {
        "input_tokens": len(bearing[0]["prompt_token_ids"]),
        "output_tokens": sum(len(item["generation_token_ids"]) for item in bearing),
    }
    return {"id": f"proj-{rollout_id}", "model": model, "object": "response", "output": items, "usage": usage}


def main_chain(build: BuildOutput) -> Chain:
    if not build.chains:
        raise ValueError("capture produced no safe trainable chain")
    if not build.notes.merged and len(build.chains) > 1:
        raise ValueError(
            f"per_request produced {len(build.chains)} trajectories; single-response delivery needs exactly one"
        )
    for chain in build.chains:
        if chain.chain_id == "main":
            return chain
    return build.chains[0]


def project_main_chain_response(rollout_id: str, out: BuildOutput, model: str = "") -> dict:
    """The main chain of a builder's output `out` as one Responses payload (SPEC section 4)."""
    return response_from_items(rollout_id, project_chain_to_output_items(main_chain(out)), model)


def assert_prefix_contiguity(response: dict) -> None:
    """Walk `response["output"]`: every item carrying generation_token_ids must have a
    prompt_token_ids that extends every prompt and generation id seen before it (a
    missing or null prompt counts as empty); otherwise AssertionError."""
    assert_items_contiguous(response["output"])


def assert_items_contiguous(items: list[dict]) -> None:
    """`assert_prefix_contiguity` over a list of output items."""
    seen: list = []
    for item in _token_bearing(items):
        prompt = item.get("prompt_token_ids") or []
        if len(prompt) < len(seen) or list(prompt[: len(seen)]) != list(seen):
            raise AssertionError(
                f"projection is not prefix-contiguous: a {item.get('type', 'item')} item's prompt of "
                f"{len(prompt)} ids does not extend the {len(seen)} ids before it"
            )
        seen = list(prompt) + list(item["generation_token_ids"])


def _has_inline_strays(projection: Projection) -> bool:
    """Does any non-carrier item still carry token arrays inline (older records)?"""
    for call in projection.calls:
        for index, item in enumerate(call.output_items):
            if index not in call.carriers and _carries_tokens(item):
                return True
    return False


def checked_usage(projection: Projection) -> dict:
    """Usage of the projected response, after the no-tokens and contiguity checks.

    Carriers' prompts are prefixes of one token array, so contiguity reduces to span
    arithmetic. An item that still carries its own inline arrays breaks that assumption;
    such chains are checked on the materialised items, exactly as written out.
    """
    if _has_inline_strays(projection):
        items = projection_items(projection)
        usage = response_from_items("", items, "")["usage"]
        assert_items_contiguous(items)
        return usage
    spans = [(call.gen_start, call.gen_end) for call in projection.calls for _ in (call.carriers or (None,))]
    if not any(end > start for start, end in spans):
        raise ValueError("capture produced no trainable generated tokens")
    seen = 0
    for start, end in spans:
        if start < seen:
            raise AssertionError(
                f"projection is not prefix-contiguous: a prompt of {start} ids does not extend the {seen} ids before it"
            )
        seen = end
    return {"input_tokens": spans[0][0], "output_tokens": sum(end - start for start, end in spans)}
