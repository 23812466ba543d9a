"""The single-rollout consumer: a frozen capture in, one build dict out.

- A build never raises: a rollout that cannot be trained on safely comes back with
  `mask_sample: True` and the reason in `error`.
- Single-response delivery projects the `main` chain only; more chains or roots, an
  unresolved retry or an incomplete capture still build, masked. `per_request` is refused.
- One code path serves the local store (`trajectories_for_rollout`), any async
  `TokenSource` (`trajectories_from_source`) and the distributed rebuild (`build_frozen`).
- NeMo Gym's seams are kept: both entry points assemble through `_assemble`, which runs
  the builder once through `run_builder`, so a wrapper sees every build.
- Gym's other consumer names live here too: `token_id_capture_dirs_from_config` and
  `maybe_rollout_id_from_run_body` (also `rollout_id_from_record`).

The long form: docs/internals.md ("The single-rollout consumer").
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from pydantic import BaseModel

from raycap.capture.builder import (
    BuildOutput,
    CallArrays,
    Projection,
    ReadEntries,
    checked_usage,
    main_chain,
    project_chain,
    projection_items,
    run_builder,
)
from raycap.capture.config import token_id_capture_config
from raycap.capture.maskreasons import verdict
from raycap.capture.protocols import install_token_sink as install_token_sink  # re-exported: NeMo Gym has it here
from raycap.capture.records import TokenEntry, parse_records
from raycap.capture.store import FrozenCapture, TokenCaptureStore, off_loop, validate_rollout_id

logger = logging.getLogger(__name__)
B = TypeVar("B")  # a build of either delivery

# The failures a build turns into a masked result (SPEC section 5).
CAUGHT = (AssertionError, ValueError, KeyError, IndexError, TypeError)
PER_REQUEST_REFUSED = "per_request returns multiple trajectories and is not supported by single-response delivery"
NO_RECORDS = "capture contains no token records"


@dataclass(frozen=True)
class SnapshotRef:
    """Identity of one frozen part of a rollout's capture; retirement drops exactly this.
    The one snapshot type of a directory's part: a row's `snapshots`, a stream's parts
    (`raycap.stream.steps.SnapshotPart` is this class)."""

    capture_dir: str  # the directory's label
    snapshot_id: str
    version: int

    @property
    def label(self) -> str:
        """The directory's label (`capture_dir`), as a stream's parts name it."""
        return self.capture_dir


@dataclass(frozen=True)
class Metrics:
    """Build metrics; all but n_calls are None on a failed build."""

    n_calls: int
    chains: int | None = None
    roots: int | None = None
    quarantined_calls: int | None = None
    quarantined_fraction: float | None = None
    delivered_fraction: float | None = None
    generated_tokens_captured: int | None = None
    generated_tokens_delivered: int | None = None
    empty_generation_calls: int | None = None

    def as_dict(self) -> dict:
        if self.chains is None:
            return {"n_calls": self.n_calls}
        return {
            "n_calls": self.n_calls,
            "chains": self.chains,
            "roots": self.roots,
            "quarantined_calls": self.quarantined_calls,
            "quarantined_fraction": self.quarantined_fraction,
            "delivered_fraction": self.delivered_fraction,
            "generated_tokens_captured": self.generated_tokens_captured,
            "generated_tokens_delivered": self.generated_tokens_delivered,
            "empty_generation_calls": self.empty_generation_calls,
        }


@dataclass
class RolloutBuild:
    """Typed result of building one rollout; `to_build()` gives the spec's dict."""

    rollout_id: str
    builder: str
    model: str
    metrics: Metrics
    error: str | None = None
    projection: Projection | None = None
    usage: dict | None = None
    unresolved_retries: list[str] | None = None
    build: BuildOutput | None = None
    snapshots: tuple[SnapshotRef, ...] = ()  # empty when freezing failed
    incomplete: bool = False
    mask_reasons: list[str] = field(default_factory=list)

    @property
    def mask_sample(self) -> bool:
        return self.error is not None or bool(self.mask_reasons) or self.incomplete

    def response(self, items: Callable[[Projection], list[dict]] = projection_items) -> dict | None:
        """The rebuilt response; `items` makes its output items from the projection
        (`raycap.rows.tokentext.projection_text_items` gives them as orjson fragments)."""
        if self.projection is None:
            return None
        return {
            "id": f"proj-{self.rollout_id}",
            "model": self.model,
            "object": "response",
            "output": items(self.projection),
            "usage": dict(self.usage or {}),
        }

    def to_build(self, items: Callable[[Projection], list[dict]] = projection_items) -> dict:
        metrics = self.metrics.as_dict()
        if self.error is not None:
            out: dict[str, Any] = {
                "rollout_id": self.rollout_id,
                "builder": self.builder,
                "rebuilt_response": None,
                "mask_sample": True,
                "error": self.error,
                "metrics": metrics,
            }
        else:
            out = {
                "rollout_id": self.rollout_id,
                "builder": self.builder,
                "rebuilt_response": self.response(items),
                "metrics": metrics,
                "mask_sample": self.mask_sample,
                "unresolved_retries": list(self.unresolved_retries or []),
            }
        return _with_capture_state(out, self.incomplete, self.snapshots[0] if self.snapshots else None)


def _with_capture_state(build: dict, incomplete: bool, snapshot: SnapshotRef | None) -> dict:
    """Mark a build dict with its capture's state: an incomplete capture masks the
    rollout; a successful freeze adds the snapshot identity that retirement drops."""
    if incomplete:
        build["mask_sample"] = True
        build["metrics"]["capture_incomplete"] = True
    if snapshot is not None:
        build["_capture_snapshot"] = {"snapshot_id": snapshot.snapshot_id, "version": snapshot.version}
    return build


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def failed_build(rollout_id: str, builder: str, model: str, error: str, n_calls: int = 0) -> RolloutBuild:
    """A masked result carrying the error; no trajectory."""
    return RolloutBuild(rollout_id, builder, model, Metrics(n_calls=n_calls), error=error)


def _failed_build(rollout_id: str, builder: str, error: str, n_calls: int = 0) -> dict:
    return failed_build(rollout_id, builder, "", error, n_calls).to_build()


def run_validated(builder: str, entries: Sequence[TokenEntry], arrays: Sequence[CallArrays] | None) -> BuildOutput:
    """Run the builder once, through this module's `run_builder`, and validate every
    chain (`Chain.validate`). Without arrays the call is exactly
    `run_builder(entries, builder)`, the signature a wrapper of NeMo Gym's seam expects."""
    if arrays is None:
        build = run_builder(entries, builder)
    else:
        build = run_builder(entries, builder, arrays=arrays)
    for chain in build.chains:
        chain.validate()
    return build


def assemble(
    rollout_id: str,
    entries: Sequence[TokenEntry],
    builder: str,
    model: str,
    arrays: Sequence[CallArrays] | None = None,
) -> RolloutBuild:
    """Build and project one rollout's entries; failures become masked results."""
    n_calls = len(entries)
    if builder == "per_request":
        # Not an exception: like "no records", the refusal is stated as a plain phrase.
        return failed_build(rollout_id, builder, model, PER_REQUEST_REFUSED, n_calls)
    try:
        build = run_validated(builder, entries, arrays)
        projection = project_chain(main_chain(build))
        usage = checked_usage(projection)
    except CAUGHT as exc:
        logger.warning("rollout %s: build with %s failed, masking it: %s", rollout_id, builder, error_text(exc))
        return failed_build(rollout_id, builder, model, error_text(exc), n_calls)
    notes = build.notes
    quarantined = len(build.quarantined)
    metrics = Metrics(
        n_calls=n_calls,
        chains=notes.chains,
        roots=notes.roots,
        quarantined_calls=quarantined,
        quarantined_fraction=round(quarantined / n_calls, 4),
        delivered_fraction=notes.delivered_fraction,
        generated_tokens_captured=notes.generated_tokens_captured,
        generated_tokens_delivered=notes.generated_tokens_delivered,
        empty_generation_calls=len(notes.empty_generation_calls),
    )
    reasons = verdict(bool(notes.unresolved_retries), notes.roots, notes.chains)
    return RolloutBuild(
        rollout_id,
        builder,
        model,
        metrics,
        projection=projection,
        usage=usage,
        unresolved_retries=list(notes.unresolved_retries),
        build=build,
        mask_reasons=reasons,
    )


def _assemble(rollout_id: str, entries: list[TokenEntry], builder: str, model: str) -> dict:
    """Build and project one rollout's entries into the spec's build dict (the seam
    the single-rollout API assembles through)."""
    return assemble(rollout_id, entries, builder, model).to_build()


def build_entries(
    rollout_id: str,
    entries: Sequence[TokenEntry],
    *,
    incomplete: bool,
    snapshots: tuple[SnapshotRef, ...],
    builder: str,
    model: str,
    arrays: Sequence[CallArrays] | None = None,
) -> RolloutBuild:
    """Build a frozen capture's entries and attach its snapshot identity."""
    if not entries:
        result = failed_build(rollout_id, builder, model, NO_RECORDS)
    else:
        result = assemble(rollout_id, entries, builder, model, arrays)
    result.snapshots = snapshots
    result.incomplete = incomplete
    return result


@dataclass(frozen=True)
class FrozenRead:
    """The parsed records of a rollout's frozen parts, with their identity."""

    entries: list[TokenEntry]
    arrays: list[CallArrays]
    incomplete: bool
    snapshots: tuple[SnapshotRef, ...]


def read_frozen(rollout_id: str, parts: Sequence[tuple[str, FrozenCapture]]) -> FrozenRead | str:
    """Parse and validate raw frozen parts (capture_dir, FrozenCapture); an error text
    when a record is unreadable.

    Records are parsed here, not in the store's process, so that parsing runs wherever
    the build runs. A record that fails validation fails the freeze as a whole: the
    caller reports the error with no snapshot identity, like a failed freeze.
    """
    records = []
    try:
        for _, frozen in parts:
            records.extend(frozen.take_parsed() or parse_records(frozen.data, prompt_lists=False))
    except Exception as exc:  # noqa: BLE001 - any unreadable record masks the rollout
        logger.warning("rollout %s: capture records unreadable, masking it: %s", rollout_id, error_text(exc))
        return error_text(exc)
    return FrozenRead(
        [entry for entry, _ in records],
        [arrays for _, arrays in records],
        any(f.incomplete for _, f in parts),
        tuple(SnapshotRef(d, f.snapshot_id, f.version) for d, f in parts),
    )


def build_frozen(
    rollout_id: str,
    parts: Sequence[tuple[str, FrozenCapture]],
    *,
    builder: str = "prefix_merging",
    model: str = "",
) -> RolloutBuild:
    """Build from raw frozen parts (capture_dir, FrozenCapture), one per directory."""
    return from_frozen(rollout_id, parts, builder, model, failed_build, _assemble_rollout)


def from_frozen(
    rollout_id: str,
    parts: Sequence[tuple[str, FrozenCapture]],
    builder: str,
    model: str,
    failed: Callable[[str, str, str, str], B],
    assemble: Callable[..., B],
) -> B:
    """The one way from raw frozen parts to a build, in either delivery (`build_frozen`,
    `raycap.rows.chains.build_frozen_chains`): `failed(rollout_id, builder, model, error)`
    when a record is unreadable, else `assemble(rollout_id, entries, builder, model,
    arrays, incomplete=..., snapshots=...)` on what `read_frozen` parsed."""
    read = read_frozen(rollout_id, parts)
    if isinstance(read, str):
        return failed(rollout_id, builder, model, read)
    return assemble(
        rollout_id, read.entries, builder, model, read.arrays, incomplete=read.incomplete, snapshots=read.snapshots
    )


def _assemble_rollout(
    rollout_id: str,
    entries: Sequence[TokenEntry],
    builder: str,
    model: str,
    arrays: Any,
    *,
    incomplete: bool,
    snapshots: tuple[SnapshotRef, ...],
) -> RolloutBuild:
    return build_entries(
        rollout_id, entries, incomplete=incomplete, snapshots=snapshots, builder=builder, model=model, arrays=arrays
    )


def build_local(rollout_id: str, directory: str | Path, *, builder: str = "prefix_merging", model: str = "") -> RolloutBuild:
    """Freeze one rollout in a local capture directory and build it."""
    try:
        frozen = TokenCaptureStore(directory).freeze_raw(rollout_id)
    except Exception as exc:  # noqa: BLE001 - a failed freeze is a masked result
        logger.warning("rollout %s: freeze in %s failed, masking it: %s", rollout_id, directory, error_text(exc))
        return failed_build(rollout_id, builder, model, error_text(exc))
    return build_frozen(rollout_id, [(str(directory), frozen)], builder=builder, model=model)


def _build_snapshot(
    rollout_id: str,
    entries: list[TokenEntry],
    *,
    incomplete: bool,
    snapshot: SnapshotRef,
    builder: str,
    model: str,
) -> dict:
    """The single-rollout build of a frozen snapshot, assembled through `_assemble`."""
    if not entries:
        build = _failed_build(rollout_id, builder, NO_RECORDS)
    else:
        build = _assemble(rollout_id, entries, builder, model)
    return _with_capture_state(build, incomplete, snapshot)


def trajectories_for_rollout(
    rollout_id: str,
    token_capture_dirs: Sequence[str | Path],
    builder: str = "prefix_merging",
    model: str = "",
) -> dict | None:
    """Build trajectories from a frozen local token-store snapshot (first directory only).

    None only when no capture directory is configured; missing records and incomplete
    snapshots are masked results."""
    if not token_capture_dirs:
        return None
    directory = token_capture_dirs[0]
    try:
        frozen = TokenCaptureStore(directory).freeze_raw(rollout_id)
    except Exception as exc:  # noqa: BLE001 - a failed freeze is a masked result
        logger.warning("rollout %s: freeze in %s failed, masking it: %s", rollout_id, directory, error_text(exc))
        return _failed_build(rollout_id, builder, error_text(exc))
    read = read_frozen(rollout_id, [(str(directory), frozen)])
    if isinstance(read, str):
        return _failed_build(rollout_id, builder, read)
    # The entries a wrapper of _assemble sees hold their prompt ids as lists, like any
    # TokenEntry; the builder still takes the arrays the reader converted.
    for entry, arrays in zip(read.entries, read.arrays):
        entry.prompt_token_ids = arrays.prompt.tolist()
    return _build_snapshot(
        rollout_id,
        ReadEntries(read.entries, read.arrays),
        incomplete=read.incomplete,
        snapshot=read.snapshots[0],
        builder=builder,
        model=model,
    )


async def trajectories_from_source(
    rollout_id: str,
    source: Any,
    builder: str = "prefix_merging",
    model: str = "",
) -> dict | None:
    """Build trajectories from a frozen `TokenSource` snapshot; `_assemble` runs in a
    worker thread, never on the caller's event loop."""
    try:
        snapshot = await source.freeze(rollout_id)
    except Exception as exc:  # noqa: BLE001 - a failed freeze is a masked result
        logger.warning("rollout %s: freeze failed, masking it: %s", rollout_id, error_text(exc))
        return _failed_build(rollout_id, builder, error_text(exc))
    return await off_loop(
        _build_snapshot,
        rollout_id,
        list(snapshot.entries),
        incomplete=snapshot.incomplete,
        snapshot=SnapshotRef("", snapshot.snapshot_id, snapshot.version),
        builder=builder,
        model=model,
    )


# --- configuration --------------------------------------------------------------------


def token_id_capture_dirs_from_config(global_config_dict: Any) -> list[Path]:
    """The capture directory of an enabled `token_id_capture` block without a sink, as a
    one-item list; [] otherwise. The config is validated first (`raycap.capture.config`): an
    enabled block needs an absolute directory unless a sink is configured or installed,
    or rebuild_response is false."""
    config = token_id_capture_config(global_config_dict)
    if not config.enabled or config.token_id_capture.sink is not None:
        return []
    directory = config.resolved_dir()
    return [] if directory is None else [directory]


# --- rollout identity and clearing stale captures before dispatch ------------------------

# Applied with `.match`, as NeMo Gym applies it: `$` also matches before a final newline,
# so such an id passes here and the store refuses it (`validate_rollout_id`).
ROLLOUT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _body_get(body: Any, key: str) -> Any:
    if isinstance(body, Mapping):
        return body.get(key)
    return getattr(body, key, None)


def maybe_rollout_id_from_run_body(body: Any) -> str | None:
    """The rollout id of a run request body or run record, or None when it has none.

    Only a pydantic model or a Mapping has one. An explicit `_ng_rollout_id` wins and must
    be a string matching ROLLOUT_ID_PATTERN (ValueError otherwise); else the id is
    "{task}-{rollout}" from `_ng_task_index` and `_ng_rollout_index` (None when either is
    missing). A positive `_ng_attempt_index` n appends "-a{n}", explicit ids included: a
    retried attempt must never share its id with the previous one, or its records would
    be merged with them. An attempt index that `int()` refuses raises its error.
    """
    if not isinstance(body, (BaseModel, Mapping)):
        return None
    explicit = _body_get(body, "_ng_rollout_id")
    if explicit is not None:
        if not isinstance(explicit, str) or not ROLLOUT_ID_PATTERN.match(explicit):
            raise ValueError(
                "_ng_rollout_id must be a string of letters, digits, dots, dashes or underscores, starting "
                f"with a letter or digit (got {explicit!r})"
            )
        rollout_id = explicit
    else:
        task, index = _body_get(body, "_ng_task_index"), _body_get(body, "_ng_rollout_index")
        if task is None or index is None:
            return None
        rollout_id = f"{task}-{index}"
    attempt = _body_get(body, "_ng_attempt_index")
    if attempt is not None and int(attempt) > 0:
        rollout_id = f"{rollout_id}-a{int(attempt)}"
    return rollout_id


# raycap's earlier name for the same rule.
rollout_id_from_record = maybe_rollout_id_from_run_body


def clear_token_captures_for_rollouts(records: Iterable[Any], token_capture_dirs: Sequence[str | Path]) -> None:
    """Remove stale token records for rollouts about to be dispatched.

    Rollout ids are deterministic and the store appends, so a reused id would merge a
    new attempt with the records of a previous one. Every record's id is derived and
    checked (the store's rule too) before anything is deleted: a bad record deletes
    nothing."""
    if not token_capture_dirs:
        return
    rollout_ids = [rid for rid in (maybe_rollout_id_from_run_body(record) for record in records) if rid is not None]
    for rollout_id in rollout_ids:
        validate_rollout_id(rollout_id)
    for directory in token_capture_dirs:
        store = TokenCaptureStore(directory)
        for rollout_id in rollout_ids:
            store.delete(rollout_id)
