"""Finalizing a rollout record: the rebuilt response replaces the served one.

`finalize_rollout_token_capture(result, source)` freezes the rollout's capture, builds
its main chain (`raycap.capture.consumer`) and writes into the record:

- `result["response"]["output"]`: the rebuilt output, with the sampled token ids and
  log probs (a masked build too);
- `result["_ng_token_capture"]` (TOKEN_CAPTURE_KEY): the build's metrics and error;
- `result["mask_sample"]` (MASK_SAMPLE_KEY): True when it must not be trained on.

It never raises: an unusable capture masks the record, with the reason and a warning. A
record that carries token ids already keeps its response; its capture is frozen only to
be retired, as redundant. The steps are also synchronous functions (`plan_record`,
`mark_unusable`, `redundant_build`, `apply_build`), so `raycap.finalize_rollouts` writes
each record by the same rules.

Retirement comes after the record is durable: `capture_build_can_retire` says whether a
build's capture may be dropped, `retire_rollout_token_capture` drops exactly the
snapshot it consumed. A masked rollout's capture is kept as evidence.

The rules in full: docs/internals.md ("Finalizing a rollout record"). No Ray, no server stack.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from raycap.capture import consumer
from raycap.capture.consumer import (
    ROLLOUT_ID_PATTERN as ROLLOUT_ID_PATTERN,  # re-exported: the rule of the ids this module reads
)
from raycap.capture.consumer import maybe_rollout_id_from_run_body, trajectories_from_source
from raycap.capture.protocols import TokenSource

_CONSUMERS_OWN = trajectories_from_source

TOKEN_CAPTURE_KEY = "_ng_token_capture"
MASK_SAMPLE_KEY = "mask_sample"
# Keys of a build dict that only delivery reads.
_REDUNDANT_CAPTURE_KEY = "_redundant_capture"
_CAPTURE_SNAPSHOT_KEY = "_capture_snapshot"


def rollout_carries_token_ids(result: Any) -> bool:
    """Whether the record's own response already carries generated token ids."""
    response = result.get("response") if isinstance(result, Mapping) else None
    if not isinstance(response, dict):
        return False
    output = response.get("output")
    return isinstance(output, list) and any(
        isinstance(item, dict) and bool(item.get("generation_token_ids")) for item in output
    )


# The reason a record without a rollout id is masked, and what its warning says: the
# record carries the short reason (records are aggregated by it), the warning the rule.
NO_CAPTURE_KEY = "no capture key"
_NO_ID_WARNING = (
    "Token capture is unusable: the rollout carries no id (no _ng_rollout_id, or _ng_task_index/"
    "_ng_rollout_index), so no capture can be found for it; it is marked for masking: " + NO_CAPTURE_KEY
)


def _unusable(result: Any, error: str, rollout_id: str | None = None) -> dict:
    """Mask the record because its capture cannot be used, saying why."""
    if error == NO_CAPTURE_KEY:
        message = _NO_ID_WARNING
    elif rollout_id is None:
        message = f"Token capture is unusable, so the rollout is marked for masking: {error}"
    else:
        message = f"Token capture of rollout {rollout_id} is unusable, so it is marked for masking: {error}"
    warnings.warn(message, stacklevel=3)
    metrics = {"n_calls": 0, "error": error}
    if isinstance(result, MutableMapping):
        result[MASK_SAMPLE_KEY] = True
        result[TOKEN_CAPTURE_KEY] = metrics
    return {"rebuilt_response": None, "mask_sample": True, "error": error, "metrics": metrics}


def mark_unusable(result: Any, error: str) -> dict:
    """Mask `result` in place because its capture cannot be used (`error` says why) and
    return the build that says so, as the finalizer does (with a warning)."""
    return _unusable(result, error)


def record_model(result: Any) -> str:
    """The model a record's rebuilt response names: its `response.model`, as the
    finalizer takes it ("" when there is none)."""
    response = result.get("response") if isinstance(result, Mapping) else None
    model = response.get("model") if isinstance(response, dict) else None
    return model if isinstance(model, str) else ""


@dataclass(frozen=True)
class RecordPlan:
    """What finalizing a record takes, read from the record alone (steps 2 to 4 of the
    finalizer): an `error` when its capture is unusable before any is read; `redundant`
    when the record carries its own token ids (then `rollout_id` may be None: nothing to
    do); else the rollout to build and the `model` its rebuilt response names."""

    rollout_id: str | None
    error: str | None = None
    redundant: bool = False
    model: str = ""


def plan_record(result: Any) -> RecordPlan:
    """How `result` is finalized, decided from the record before any capture is read.
    The rollout id is read by Gym's rule; an id it refuses makes the record unusable."""
    try:
        rollout_id = maybe_rollout_id_from_run_body(result)
    except (TypeError, ValueError) as err:
        return RecordPlan(None, error=f"malformed rollout id: {err}")
    if rollout_carries_token_ids(result):
        return RecordPlan(rollout_id, redundant=True)
    if rollout_id is None:
        return RecordPlan(None, error=NO_CAPTURE_KEY)
    return RecordPlan(rollout_id, model=record_model(result))


def redundant_build(snapshot_id: str, version: int) -> dict:
    """The build of a record that carries its own token ids: nothing rebuilt, the
    frozen capture reported as redundant so that it can be retired."""
    return {
        "rebuilt_response": None,
        "mask_sample": False,
        _REDUNDANT_CAPTURE_KEY: True,
        _CAPTURE_SNAPSHOT_KEY: {"snapshot_id": snapshot_id, "version": version},
    }


def apply_build(result: Any, rollout_id: str, built: dict | None) -> dict:
    """Write what a finished build of `rollout_id` says into `result`, in place (steps 5
    to 7 of the finalizer, after the build returned), and return the build: None (the
    build found nothing) masks the record; a rebuilt response, masked or not, replaces
    the served output; the metrics (and error) go to TOKEN_CAPTURE_KEY; a masked build
    sets MASK_SAMPLE_KEY and warns. One rule for a record finalized alone
    (`finalize_rollout_token_capture`) and for a results file finalized at once
    (`raycap.finalize_rollouts`)."""
    if built is None:
        return _unusable(result, "nothing recorded", rollout_id)
    if not isinstance(result, MutableMapping):
        return built  # a record that cannot be written into keeps its response
    rebuilt = built.get("rebuilt_response")
    if rebuilt is not None:
        # Even a masked build's response replaces the served one: it is what the capture
        # says was sampled, and the mask keeps it out of training.
        response = result.get("response")
        if isinstance(response, dict):
            response["output"] = rebuilt["output"]
        else:
            result["response"] = rebuilt
    capture = dict(built.get("metrics") or {})
    if built.get("error"):
        capture["error"] = built["error"]
    result[TOKEN_CAPTURE_KEY] = capture
    if built.get("mask_sample"):
        result[MASK_SAMPLE_KEY] = True
        warnings.warn(
            f"Token capture of rollout {rollout_id} is marked for masking: "
            f"{built.get('error') or _mask_reasons(built)}",
            stacklevel=2,
        )
    return built


async def finalize_rollout_token_capture(result: Any, source: TokenSource | None) -> dict | None:
    """Rebuild one finished rollout record from its capture, in place; the build dict,
    or None when there is nothing to finalize (no source, or a record with inline token
    ids but no rollout id or no snapshot). Never raises."""
    if source is None:
        return None
    plan = plan_record(result)
    if plan.error is not None:
        return _unusable(result, plan.error)
    rollout_id = plan.rollout_id
    if plan.redundant:
        if rollout_id is None:
            return None
        try:
            snapshot = await source.freeze(rollout_id)
        except Exception as err:  # noqa: BLE001 - never raises; the record keeps its own tokens
            warnings.warn(
                f"rollout {rollout_id} carries its own token ids, and freezing its redundant capture failed "
                f"({type(err).__name__}: {err}); the capture is left in place",
                stacklevel=2,
            )
            return None
        return redundant_build(snapshot.snapshot_id, snapshot.version)
    assert rollout_id is not None
    # A wrapper of the build (to trace, count or offload it) may replace it here or in the
    # consumer module; either is honoured.
    build = trajectories_from_source if trajectories_from_source is not _CONSUMERS_OWN else consumer.trajectories_from_source
    try:
        built = await build(rollout_id, source, model=plan.model)
    except Exception as err:  # noqa: BLE001 - never raises; the rollout is masked with the reason
        return _unusable(result, f"{type(err).__name__}: {err}", rollout_id)
    return apply_build(result, rollout_id, built)


def _mask_reasons(built: Mapping) -> str:
    metrics = built.get("metrics") or {}
    reasons = []
    if metrics.get("capture_incomplete"):
        reasons.append("the capture is incomplete")
    if built.get("unresolved_retries"):
        reasons.append(f"unresolved retries {built['unresolved_retries']}")
    if metrics.get("roots", 1) != 1 or metrics.get("chains", 1) != 1:
        reasons.append(f"{metrics.get('roots')} roots and {metrics.get('chains')} chains, where one of each is trainable")
    return "; ".join(reasons) or "the build is masked"


def capture_build_can_retire(built: Mapping | None) -> bool:
    """Whether the capture a build consumed may be dropped once its record is durable:
    only for an unmasked build that delivered a rebuilt response, or a redundant capture."""
    if built is None or built.get("mask_sample"):
        return False
    return built.get("rebuilt_response") is not None or bool(built.get(_REDUNDANT_CAPTURE_KEY))


async def retire_rollout_token_capture(rollout_id: str, source: TokenSource | None, built: Mapping | None) -> bool:
    """Drop exactly the snapshot `built` consumed; False when it may not be retired or
    the drop did not happen (a warning says why). Never raises."""
    if source is None or not capture_build_can_retire(built):
        return False
    snapshot = built.get(_CAPTURE_SNAPSHOT_KEY)
    if not isinstance(snapshot, dict):
        warnings.warn(f"rollout {rollout_id}: the build has no capture snapshot to retire", stacklevel=2)
        return False
    try:
        return bool(
            await source.drop(rollout_id, snapshot_id=str(snapshot["snapshot_id"]), version=int(snapshot["version"]))
        )
    except Exception as err:  # noqa: BLE001 - never raises; the capture stays and a later run retires it
        warnings.warn(f"rollout {rollout_id}: retiring its capture failed ({type(err).__name__}: {err})", stacklevel=2)
        return False
