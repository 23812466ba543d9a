"""How a training step's ids are cut between the calling process and its builder tasks.

A step (at most one batch per CPU, on the caller's node: `raycap.cluster.rebuild.scheduler`)
is either shared, the caller building one batch while builder tasks build the others,
or built by the caller alone. `StepSplit` chooses, and cuts a shared step, from how the
session's steps before went. It holds no Ray state.
"""

from __future__ import annotations

# The ids of a step this process builds itself, in builder tasks' shares, before any
# step was measured (see `StepSplit`).
HERE_SHARES = 2
# The fewest ids of a step worth a builder task (see `StepSplit`): a task's start and the
# trip of its rows back cost this process more than building fewer itself.
MIN_TASK_IDS = 8
# Every PROBE_EVERY-th step is built the way that was slower so far (see `StepSplit`).
PROBE_EVERY = 4


class StepSplit:
    """How a training step's ids are cut between this process and its builder tasks,
    learned from the steps before (a session keeps one).

    Two ways, each step timed whole, per id (`pace`, halfway to each new step's): shared
    with builder tasks, or built here alone. A step takes the faster way so far, and
    every PROBE_EVERY-th step the other, so a change of the machine's load is seen. On
    two cores busy with other work a task adds no core: Ray starts its workers niced,
    so a task crawls while it still takes CPU from this process, and a step alone is
    faster; on idle cores a shared step is.

    A shared step's cut follows `speed`: a task's ids per second over this process's,
    measured from when its rows were built (its start included), moved halfway to each
    new measure; each task gets `speed` times the ids this process builds, so both end
    together, at least MIN_TASK_IDS and at most an even share. A task whose batch this
    process took over before it started measured a speed of 0."""

    def __init__(self) -> None:
        self.speed = 1.0 / HERE_SHARES
        self.pace: dict[bool, float] = {}  # shared or not -> seconds per id of a whole step
        self.steps = 0
        self.shared: bool | None = True  # the way of the step cut last (None: too small to choose)

    def task_ids(self, n: int, tasks: int) -> int:
        """The ids each of `tasks` builder tasks gets of the next step of n ids (0: the
        step is built here alone). Chooses the step's way, and counts it."""
        even = n // (tasks + 1)
        if even < MIN_TASK_IDS:
            self.shared = None
            return 0  # too small a step to be worth a task
        faster = self.pace.get(True, 0.0) <= self.pace.get(False, 0.0)  # a way not yet timed first
        self.steps += 1
        self.shared = faster if self.steps % PROBE_EVERY else not faster
        if not self.shared:
            return 0
        return max(MIN_TASK_IDS, min(round(n * self.speed / (1.0 + tasks * self.speed)), even))

    def stepped(self, ids: int, seconds: float) -> None:
        """A step cut by the last `task_ids` took `seconds` for its `ids`."""
        if self.shared is None:
            return
        seen = seconds / max(ids, 1)
        known = self.pace.get(self.shared)
        self.pace[self.shared] = seen if known is None else (known + seen) / 2

    def measured(self, here_ids: int, here_s: float, task_ids: int, task_s: float | None) -> None:
        """A shared step's measure: this process built `here_ids` in `here_s` seconds, a
        task `task_ids` in `task_s` (None: this process took them over)."""
        if here_ids < 1 or here_s <= 0:
            return
        seen = 0.0 if task_s is None or task_ids < 1 else (task_ids / max(task_s, 1e-6)) / (here_ids / here_s)
        self.speed = min(1.0, (self.speed + seen) / 2)
