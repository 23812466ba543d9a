"""Request-scoped capture: how a model server records the tokens of one model call.

A server sets a `CaptureContext` (rollout id, call id, sink) for the request with
`set_token_sink` and resets it with `reset_token_sink`; it lives in a context variable,
so concurrent requests never see each other's. Then, with no arguments to pass:

- `register_call_intent()` announces the call before it is dispatched; its errors
  propagate, because a call that cannot be announced should not be made;
- `capture_tokens(response)` turns the served response into a `TokenEntry` and commits it;
- `commit_entry(entry)` writes an entry the server built itself.

Capture never fails the model call: what goes wrong is logged and the rollout is marked
incomplete (`mark_incomplete`), so the consumer masks it. Without a context every
function does nothing.

The cases in full: docs/internals.md ("Request-scoped capture"). This module imports
neither Ray nor any server stack.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from raycap.capture.protocols import TokenSink
from raycap.capture.records import TokenEntry, extract_token_fields, response_to_output_items, strip_token_fields

logger = logging.getLogger(__name__)


@dataclass
class CaptureContext:
    """What one request captures into: `committed` turns True once its entry is written."""

    rollout_id: str
    model_call_id: str
    token_sink: TokenSink | None
    model: str = ""
    committed: bool = False


_CONTEXT: ContextVar[CaptureContext | None] = ContextVar("raycap_token_capture_context", default=None)


def set_token_sink(context: CaptureContext | None) -> Token:
    """Make `context` the current request's capture context; pass the returned token to
    `reset_token_sink` when the request ends."""
    return _CONTEXT.set(context)


def reset_token_sink(token: Token) -> None:
    _CONTEXT.reset(token)


def current_capture_context() -> CaptureContext | None:
    return _CONTEXT.get()


async def register_call_intent() -> None:
    """Announce the current call to the sink before dispatching it (when the sink has
    `begin_call`)."""
    context = current_capture_context()
    if context is None or context.token_sink is None:
        return
    begin_call = getattr(context.token_sink, "begin_call", None)
    if begin_call is None:
        return
    await begin_call(context.rollout_id, context.model_call_id)


async def capture_tokens(response: Any) -> None:
    """Record the token ids a served response carries as the current call's entry."""
    context = current_capture_context()
    if context is None:
        return
    try:
        if hasattr(response, "model_dump"):
            payload = response.model_dump()
        elif isinstance(response, dict):
            payload = response
        else:
            await _missing(context, f"the response is a {type(response).__name__}")
            return
        fields = extract_token_fields(payload)
        if fields is None:
            await _missing(context, "the response carries no token ids")
            return
        items, token_item_index = strip_token_fields(response_to_output_items(payload))
        payload_model = payload.get("model")
        entry = TokenEntry(
            rollout_id=context.rollout_id,
            model_call_id=context.model_call_id,
            model=context.model or (payload_model if isinstance(payload_model, str) else "") or "",
            prompt_token_ids=fields["prompt_token_ids"],
            generation_token_ids=fields["generation_token_ids"],
            generation_log_probs=fields["generation_log_probs"],
            routed_experts=fields["routed_experts"],
            output_items=items,
            token_item_index=token_item_index,
            created_at=time.time(),
        )
    except Exception:  # noqa: BLE001 - capture never fails the model call; the rollout is masked
        await _failed(context, "build")
        return
    await commit_entry(entry)


async def commit_entry(entry: TokenEntry) -> None:
    """Write `entry` through the current context's sink."""
    context = current_capture_context()
    if context is None:
        return
    if (entry.rollout_id, entry.model_call_id) != (context.rollout_id, context.model_call_id):
        # Written under the wrong ids, the record would join another call or rollout.
        logger.warning(
            "Training-token capture identity mismatch: entry %s/%s is not the request's call %s/%s; "
            "it is not written and the rollout is marked incomplete.",
            entry.rollout_id,
            entry.model_call_id,
            context.rollout_id,
            context.model_call_id,
        )
        await _mark(context)
        return
    if context.token_sink is None:
        context.committed = True
        return
    try:
        await context.token_sink.put(entry)
    except Exception:  # noqa: BLE001 - capture never fails the model call; the rollout is masked
        await _failed(context, "write")
        return
    context.committed = True


async def _failed(context: CaptureContext, stage: str) -> None:
    logger.warning(
        "Training-token capture failed to %s the record of rollout %s, call %s; marking the rollout incomplete.",
        stage,
        context.rollout_id,
        context.model_call_id,
        exc_info=True,
    )
    await _mark(context)


async def _missing(context: CaptureContext, reason: str) -> None:
    if context.committed or context.token_sink is None:
        return
    logger.warning(
        "Training-token capture has no token ids for rollout %s, call %s; marking the rollout incomplete: %s",
        context.rollout_id,
        context.model_call_id,
        reason,
    )
    await _mark(context)


async def _mark(context: CaptureContext) -> None:
    sink = context.token_sink
    mark_incomplete = getattr(sink, "mark_incomplete", None)
    if mark_incomplete is None:
        logger.error(
            "Sink %s does not implement mark_incomplete. Rollout %s (call %s) cannot be masked and may be "
            "trained on with a call missing; give the sink a mark_incomplete method.",
            type(sink).__name__,
            context.rollout_id,
            context.model_call_id,
        )
        return
    try:
        await mark_incomplete(context.rollout_id, context.model_call_id)
    except Exception:  # noqa: BLE001 - capture never fails the model call
        logger.warning("Could not mark rollout %s incomplete.", context.rollout_id, exc_info=True)
