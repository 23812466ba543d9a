"""A stream's building ahead: ready rollouts built in order, a few builds at a time.

A stream (`raycap.runs.stream.Stream`) builds its ready rollouts ahead of its takes, bounded
by `max_ahead_rows` and `max_ahead_bytes` (a waiting taker may lift the row bound to its
own `n`). Each build takes the front of the ready queue, up to the directories'
`build_batch` rollouts. Where a build is a round trip to other processes (directories
served by their nodes' actors), a rollout that becomes ready while one build is out
would wait for it to come back before its own build started, so a taker in take(1)
would pay up to two round trips per rollout. So up to the directories'
`builds_in_flight` builds are out at once, each started as soon as there is something
ready and room for it; their rollouts land in the built queue in the order they were
taken off the ready queue (a build that comes back early waits for the ones before it),
so takes stay in readiness order.

A build that fails is retried after `RETRY_SECONDS`: once every build out has come back,
its rollouts and those of every later build go back to the front of the ready queue, in
their order (the later builds' rows are let go), so nothing is delivered out of order
or lost.

This module does not import Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# A build call that failed (a lost node, say) is retried after this pause; its
# rollouts stay at the front of the queue.
RETRY_SECONDS = 1.0


@dataclass
class _Flight:
    ids: list[str]
    done: bool = False
    pieces: list[Any] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    error: BaseException | None = None


class BuildAhead:
    """The building ahead of `stream` (see the module docstring); `run` is its thread."""

    def __init__(self, stream: Any) -> None:
        self.s = stream
        self._flights: deque[_Flight] = deque()
        self._out = 0  # rollouts in builds not landed yet
        self._retry_at = 0.0

    def room(self) -> int:
        """How many more rollouts may be built now (under the stream's lock)."""
        s = self.s
        bound = max(s.max_ahead_rows, s._wanted)
        ahead = s._ahead_rows + self._out
        if ahead >= bound:
            return 0
        if s._ahead_bytes >= s.max_ahead_bytes and ahead >= s._wanted:
            return 0
        return bound - ahead

    def _can_start(self) -> bool:
        s = self.s
        return (bool(s._ready) and len(self._flights) < s.dirs.builds_in_flight and self.room() > 0
                and time.monotonic() >= self._retry_at)

    def run(self) -> None:
        s = self.s
        while True:
            with s._cond:
                while not s._closed and not self._can_start():
                    wait = self._retry_at - time.monotonic()
                    s._cond.wait(wait if wait > 0 else None)
                if s._closed:
                    return
                count = min(len(s._ready), s.dirs.build_batch, self.room())
                flight = _Flight([s._ready.popleft() for _ in range(count)])
                s._building.update(flight.ids)
                self._flights.append(flight)
                self._out += count
                refs = s._refs_wanted
            if s.dirs.builds_in_flight > 1:
                threading.Thread(target=self._fly, args=(flight, refs), name="raycap-stream-build-call",
                                 daemon=True).start()
            else:
                self._fly(flight, refs)

    def _fly(self, flight: _Flight, refs: bool) -> None:
        try:
            flight.pieces, flight.gone = self.s.dirs.build(flight.ids, refs)
        except Exception as exc:  # noqa: BLE001 - retried: nothing was taken or dropped
            flight.error = exc
        with self.s._cond:
            flight.done = True
            self._land()
            self.s._cond.notify_all()

    def _land(self) -> None:
        """Move the builds that came back, in their order, into the built queue (under
        the stream's lock)."""
        s = self.s
        while self._flights and self._flights[0].done:
            first = self._flights[0]
            if first.error is not None:
                if not all(f.done for f in self._flights):
                    return  # the later builds come back first: their rollouts go back too
                self._fail(list(self._flights))
                self._flights.clear()
                return
            self._flights.popleft()
            self._out -= len(first.ids)
            s._building.difference_update(first.ids)
            void, s._void = s._void & set(first.ids), s._void - set(first.ids)
            # Rollouts found no longer ready where they live (committed meanwhile, or
            # their node lost) are not delivered; a later offer may bring them back.
            s._known.difference_update(set(first.gone) - void)
            for piece in first.pieces:
                if piece.rollout_id in void:
                    continue  # forgotten while it was built (its node was lost)
                s._built.append(piece)
                s._ahead_rows += piece.rows
                s._ahead_bytes += piece.nbytes

    def _fail(self, flights: list[_Flight]) -> None:
        s = self.s
        first = flights[0]
        logger.warning("building %d ready rollouts failed (%s); retrying in %.0f s", len(first.ids), first.error,
                       RETRY_SECONDS)
        s.stats.build_failures += 1
        again: list[str] = []
        for flight in flights:
            self._out -= len(flight.ids)
            s._building.difference_update(flight.ids)
            void, s._void = s._void & set(flight.ids), s._void - set(flight.ids)
            again.extend(rid for rid in flight.ids if rid not in void)
            if flight.error is None:
                s._known.difference_update(set(flight.gone) - void)
                gone = set(flight.gone)
                again = [rid for rid in again if rid not in gone]
                discard = getattr(s.dirs, "discard", None)
                if discard is not None and flight.pieces:
                    discard(flight.pieces)
        s._ready.extendleft(reversed(again))
        self._retry_at = time.monotonic() + RETRY_SECONDS
