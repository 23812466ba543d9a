"""The options of a rebuild, as one frozen value built and checked at the front door.

Every layer below the front door (`raycap.rebuild`, `raycap.Rebuilder`, the dataset
writer `raycap.rebuild_to_output`, the jobs) takes a `RebuildOptions` and passes it on
whole; none restates the keyword list, so an option cannot be dropped on the way down.
A value that exists was validated: an unknown builder, delivery or executor, and a
batch size or in-flight bound below one, raise ValueError when it is made, before any
directory is touched. `checked_rollout_ids` is the front door's check of the ids.

Options belong to a call, never to a session: a session holds placement and actors, and
two calls on one session with different options each build with their own.

This module does not import Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping

from raycap.capture.builder import BUILDERS
from raycap.capture.rolloutfiles import MAX_CAPTURE_BYTES

DELIVERIES = ("rollout", "chains")
EXECUTORS = ("auto", "ray", "local")


@dataclass(frozen=True)
class RebuildOptions:
    """How a rebuild builds its rows, and where. The one place these options are
    documented: every entry point that takes them as keywords (`raycap.rebuild`,
    `raycap.rebuild_to_output`, `raycap.finalize_rollouts`, `raycap.Rebuilder`,
    `raycap.Stream`) refers here.

    - `builder`: the trajectory builder, "prefix_merging" (default: chains calls by token
      prefix) or "per_request" (one chain per call); see `raycap.capture.builder`.
    - `model`: the model name the rows record ("" by default; a finalized record names
      its own, its `response.model`).
    - `delivery`: "rollout" (one row per rollout, ROLLOUT_SCHEMA) or "chains" (one row
      per chain, CHAIN_SCHEMA; see `raycap.rows.chains`).
    - `batch_size`: rollouts per builder task; None sizes batches by bytes.
    - `max_in_flight`: builder tasks running at once; None: twice the CPUs, plus two.
    - `verbose`: the builders log each masked rollout and failed build in detail (see
      `raycap.rows.batch`).
    - `skip_retired`: when listing, leave out retired tombstones instead of giving each
      a masked "retired" row.
    - `executor`: where the work runs: "ray" (the cluster, or an embedded Ray started on
      first use), "local" (this process, one core, the same code and identical rows,
      without importing Ray; plain local paths only) or "auto" (default); see
      `raycap.rows.executor.decide`.
    - `max_capture_bytes`: a rollout whose capture is larger is a masked row naming this
      key, its capture never read (default `MAX_CAPTURE_BYTES`, 1 GiB; None: no limit).
    - `version_key`: the record field holding the policy version that served each call;
      rows then carry `call_versions`, `version_min` and `version_max` (see `raycap.rows.arrow`).
    - `worker_stall_s`: finalizing a results file on this machine's cores, a worker
      process that sends nothing for this many seconds (stopped, or hung on a read) is
      killed and its batches are finalized by the driver, with one warning (default
      300: far beyond a healthy worker's batch on a slow disk; see `raycap.finalize.worker`).

    Invalid values raise ValueError when the value is made, naming the known ones."""

    builder: str = "prefix_merging"
    model: str = ""
    delivery: str = "rollout"
    batch_size: int | None = None
    max_in_flight: int | None = None
    verbose: bool = False
    skip_retired: bool = False
    executor: str = "auto"
    max_capture_bytes: int | None = MAX_CAPTURE_BYTES
    version_key: str | None = None
    worker_stall_s: float = 300.0

    def __post_init__(self) -> None:
        if self.builder not in BUILDERS:
            raise ValueError(f"unknown builder {self.builder!r}; known builders: {', '.join(BUILDERS)}")
        if self.delivery not in DELIVERIES:
            raise ValueError(f"unknown delivery {self.delivery!r}; use one of: {', '.join(DELIVERIES)}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"unknown executor {self.executor!r}; use one of: {', '.join(EXECUTORS)}")
        if self.version_key is not None and (not isinstance(self.version_key, str) or not self.version_key):
            raise ValueError(f"version_key must be a record field name or None, not {self.version_key!r}")
        stall = self.worker_stall_s
        if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not 0 < stall < float("inf"):
            raise ValueError(f"worker_stall_s must be a positive number of seconds, not {stall!r}")
        for name in ("batch_size", "max_in_flight", "max_capture_bytes"):
            value = getattr(self, name)
            # bool is an int: batch_size=True is a typo, not a batch of one.
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, not {value!r}")

    @classmethod
    def of(cls, arguments: Mapping[str, object]) -> RebuildOptions:
        """The options among an entry point's arguments (its `locals()`), by field name:
        every entry that takes them as keywords makes its value here, so the list of
        options is written once, in this class."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.name in arguments})  # type: ignore[arg-type]

    def but(self, **changes: object) -> RebuildOptions:
        """A copy with `changes` (None values keep the current one), validated again."""
        given = {name: value for name, value in changes.items() if value is not None}
        return dataclasses.replace(self, **given) if given else self  # type: ignore[arg-type]


def checked_rollout_ids(rollout_ids: Iterable[str] | None) -> tuple[str, ...] | None:
    """The ids as a tuple (None: list the directories). A single str or bytes is refused
    with TypeError: iterating it would ask for one rollout per character. Repeated ids
    raise ValueError."""
    if rollout_ids is None:
        return None
    if isinstance(rollout_ids, (str, bytes, bytearray)):
        raise TypeError(
            f"rollout_ids must be a list of ids, not the single {type(rollout_ids).__name__} {rollout_ids!r:.40}; "
            "wrap a single id in a list"
        )
    ids = tuple(rollout_ids)
    counts: dict[object, int] = {}
    for rollout_id in ids:
        try:
            counts[rollout_id] = counts.get(rollout_id, 0) + 1
        except TypeError:
            raise TypeError(f"rollout id {rollout_id!r} is not a string; give ids as strings") from None
    # Each rollout is built, written and retired once: a repeat is refused, not doubled.
    repeated = [rollout_id for rollout_id, n in counts.items() if n > 1]
    if repeated:
        raise ValueError(
            f"rollout ids given more than once: {', '.join(map(str, repeated[:5]))}"
            f"{' ..' if len(repeated) > 5 else ''}; give each id once"
        )
    return ids
