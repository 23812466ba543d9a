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
from typing import Iterable

from raycap.builders import BUILDERS

DELIVERIES = ("rollout", "chains")
EXECUTORS = ("auto", "ray", "local")


@dataclass(frozen=True)
class RebuildOptions:
    """How a rebuild builds its rows, and where.

    - `builder`, `model`: the trajectory builder and the model name the rows record.
    - `delivery`: "rollout" (one row per rollout) or "chains" (one row per chain).
    - `batch_size`: rollouts per builder task; None sizes windows by bytes.
    - `max_in_flight`: builder tasks running at once; None: twice the CPUs, plus two.
    - `verbose`: log each masked rollout's whole reason (see `raycap.batch`).
    - `skip_retired`: when listing, leave out retired tombstones instead of giving each
      a masked "retired" row.
    - `executor`: "auto", "ray" or "local" (see `raycap.executor.decide`)."""

    builder: str = "prefix_merging"
    model: str = ""
    delivery: str = "rollout"
    batch_size: int | None = None
    max_in_flight: int | None = None
    verbose: bool = False
    skip_retired: bool = False
    executor: str = "auto"

    def __post_init__(self) -> None:
        if self.builder not in BUILDERS:
            raise ValueError(f"unknown builder {self.builder!r}; known builders: {', '.join(BUILDERS)}")
        if self.delivery not in DELIVERIES:
            raise ValueError(f"unknown delivery {self.delivery!r}; use one of: {', '.join(DELIVERIES)}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"unknown executor {self.executor!r}; use one of: {', '.join(EXECUTORS)}")
        for name in ("batch_size", "max_in_flight"):
            value = getattr(self, name)
            # bool is an int: batch_size=True is a typo, not a window of one.
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, not {value!r}")

    def but(self, **changes: object) -> RebuildOptions:
        """A copy with `changes` (None values keep the current one), validated again."""
        given = {name: value for name, value in changes.items() if value is not None}
        return dataclasses.replace(self, **given) if given else self  # type: ignore[arg-type]


def checked_rollout_ids(rollout_ids: Iterable[str] | None) -> tuple[str, ...] | None:
    """The ids as a tuple (None: list the directories). A single str or bytes is refused
    with TypeError: iterating it would ask for one rollout per character."""
    if rollout_ids is None:
        return None
    if isinstance(rollout_ids, (str, bytes)):
        raise TypeError(
            f"rollout_ids must be a list of ids, not the single {type(rollout_ids).__name__} {rollout_ids!r}; "
            "wrap it in a list"
        )
    return tuple(rollout_ids)
