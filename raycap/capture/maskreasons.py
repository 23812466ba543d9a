"""Why a rollout's row is masked: every reason's name, and which layer may add which.

The `mask_reasons` column lists them; summaries count masked rows by them. Who adds what:

- the builder's verdict (`raycap.capture.consumer`): UNRESOLVED_RETRIES, ROOTS, CHAINS;
- a build, freeze or chain that failed (`raycap.rows.arrow`, `raycap.rows.chains`): the
  exception's type name (`error_reason`), an open set;
- the capture (`raycap.rows.arrow`, `raycap.rows.chains`): CAPTURE_INCOMPLETE;
- the stream (`raycap.stream.steps.mask_stale`): STALE.

`row_reasons` is the one rule for a row's list. Reading a row back (`verdict_of`) drops
only what it derives again (the error's type, CAPTURE_INCOMPLETE) and keeps every other
reason, known or not: a reason it does not list still masks the rollout, never a guess
trained on. A finalized record is counted as a rollout collection counts it
(`record_reasons`, SPEC 10.6), with Gym's names: UNRESOLVED_PARENT_CALLS is its name for
unresolved retries.
"""

from __future__ import annotations

from typing import Iterable, Mapping

UNRESOLVED_RETRIES = "unresolved_retries"
ROOTS = "roots"
CHAINS = "chains"
CAPTURE_INCOMPLETE = "capture_incomplete"
STALE = "stale"
UNRESOLVED_PARENT_CALLS = "unresolved_parent_calls"


def error_reason(error: str) -> str:
    """The reason of a failed build: its error text's exception type ("Type: message")."""
    return error.split(":", 1)[0]


def verdict(unresolved_retries: bool, roots: int, chains: int) -> list[str]:
    """The builder's reasons: retries left unresolved, and not exactly one root and one chain."""
    reasons = []
    if unresolved_retries:
        reasons.append(UNRESOLVED_RETRIES)
    if roots != 1:
        reasons.append(ROOTS)
    if chains != 1:
        reasons.append(CHAINS)
    return reasons


def row_reasons(error: str | None, verdict_reasons: Iterable[str], incomplete: bool) -> list[str]:
    """A row's reasons, in order: the error's type, the verdict's, CAPTURE_INCOMPLETE."""
    reasons = [] if error is None else [error_reason(error)]
    reasons.extend(verdict_reasons)
    if incomplete:
        reasons.append(CAPTURE_INCOMPLETE)
    return reasons


def verdict_of(reasons: Iterable[str] | None) -> list[str]:
    """A row's reasons read back, less those its build derives again (CAPTURE_INCOMPLETE
    from its incomplete flag); every other reason is kept, known or not."""
    return [reason for reason in reasons or () if reason != CAPTURE_INCOMPLETE]


def record_reasons(built: Mapping) -> list[str]:
    """The reasons a rollout collection counts for a masked build (SPEC 10.6)."""
    metrics = built.get("metrics") or {}
    reasons = []
    if metrics.get("capture_incomplete"):
        reasons.append(CAPTURE_INCOMPLETE)
    if built.get("unresolved_retries"):
        reasons.append(UNRESOLVED_PARENT_CALLS)
    error = built.get("error") or metrics.get("error")
    if error:
        reasons.append(str(error))
    return reasons
