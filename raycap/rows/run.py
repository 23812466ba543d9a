"""A run: one rebuild call's results, and what ran it, carried along rather than looked up.

A `Run` is made when a call starts, with the executor choice already made; iterating it
yields the call's results in row order (Arrow tables, or the ShardInfo of each shard
written), and it counts them as they pass: rollouts done, and the shards, so the dataset
writer commits and summarises from the run itself. This module does not import Ray.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from raycap.rows.executor import ExecutorChoice
from raycap.rows.local import Progress


class Run:
    """The results of one call, in row order, and what ran it."""

    def __init__(self, choice: ExecutorChoice, progress: Callable[[Progress], None] | None = None) -> None:
        self.choice = choice
        self.rollouts = 0  # rollouts done so far (all of them once iterated)
        self.total = 0  # rollouts the call builds, known once it has started
        self.results: list[Any] = []  # what was yielded, kept only with keep=True
        self._user_progress = progress
        self._source: Iterator[Any] = iter(())
        self._keep = False

    def progress(self, state: Progress) -> None:
        """The progress callback the executors call: counted here, then passed on."""
        self.rollouts, self.total = state.done, state.total
        if self._user_progress is not None:
            self._user_progress(state)

    def start(self, source: Iterator[Any], *, keep: bool = False) -> Run:
        """Attach the executor's iterator of results; with `keep`, remember them."""
        self._source, self._keep = source, keep
        return self

    def __iter__(self) -> Iterator[Any]:
        for result in self._source:
            if self._keep:
                self.results.append(result)
            yield result
