"""A stream's figures, per step, as a flat dict for a trainer's own logger, and as series.

`StreamFigures` is told when rollouts become ready (`ready`), are taken (`took`) and
committed (`committed`); `as_dict` gives the figures under `raycap/...` keys, ready for
`wandb.log` or a TensorBoard writer, and the same figures go to Ray's metrics where Ray
runs (`raycap.observe.metrics`). Per take it does a few column operations on the rows'
verdict and version columns, never a loop over rows or tokens.

Keys: `rollouts_waiting` (ready, being built or built, not taken), `rows_delivered`,
`rollouts_delivered`, `rows_masked` and `rows_masked/<reason>` (delivered rows),
`rows_committed`, `rollouts_committed`, `retired` (snapshots dropped by commits),
`rows_uncommitted` (delivered, not committed), `freeze_to_take_s_mean` and `_max` (the
latest take's rollouts, from becoming ready to taken), `staleness_mean` and `_max` (the
latest take's rows: `current_version` minus the row's `version_min`; absent without a
version or a `current_version`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Iterable

from raycap.observe import metrics

PREFIX = "raycap/"


class StreamFigures:
    """The figures of one stream over `capture_dir` (its directories' labels, joined)."""

    def __init__(self, capture_dir: str) -> None:
        self.tags = {"capture_dir": capture_dir}
        self._lock = threading.Lock()
        self._ready_at: dict[str, float] = {}
        self._counts: Counter[str] = Counter()
        self._masked: Counter[str] = Counter()
        self._latest: dict[str, float] = {}

    def ready(self, ids: Iterable[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in ids:
                self._ready_at.setdefault(rid, now)

    def forget(self, ids: Iterable[str]) -> None:
        with self._lock:
            for rid in ids:
                self._ready_at.pop(rid, None)

    def took(self, ids: list[str], rows: Any, current_version: int | None, waiting: int) -> None:
        """A take of rollouts `ids`, delivered as `rows` (a table with `mask_sample`,
        `mask_reasons` and, when built with versions, `version_min`)."""
        import pyarrow.compute as pc

        now = time.monotonic()
        with self._lock:
            waited = [now - self._ready_at.pop(rid) for rid in ids if rid in self._ready_at]
        masked = pc.fill_null(rows.column("mask_sample"), True)
        reasons = pc.value_counts(pc.list_flatten(rows.filter(masked).column("mask_reasons"))).to_pylist()
        by_reason = {item["values"]: item["counts"] for item in reasons}
        behind: list[float] = []
        if current_version is not None and "version_min" in rows.column_names and rows.num_rows:
            versions = pc.drop_null(rows.column("version_min"))
            if len(versions):
                lag = pc.subtract(pa_scalar(current_version), versions)
                behind = [float(pc.mean(lag).as_py()), float(pc.max(lag).as_py())]
        with self._lock:
            self._counts.update(rows_delivered=rows.num_rows, rollouts_delivered=len(ids),
                                rows_masked=int(pc.sum(masked).as_py() or 0))
            self._masked.update(by_reason)
            self._latest = {}
            if waited:
                self._latest.update(freeze_to_take_s_mean=sum(waited) / len(waited), freeze_to_take_s_max=max(waited))
            if behind:
                self._latest.update(staleness_mean=behind[0], staleness_max=behind[1])
            uncommitted = self._counts["rows_delivered"] - self._counts["rows_committed"]
        if metrics.ray_here():
            metrics.count("raycap_stream_rows_delivered", rows.num_rows, self.tags)
            for reason, n in by_reason.items():
                metrics.count("raycap_stream_rows_masked_by_reason", n, {**self.tags, "reason": reason})
            for seconds in waited:  # one per rollout taken: a step's worth, not per row
                metrics.observe("raycap_stream_freeze_to_take_seconds", seconds, self.tags)
            if behind:
                metrics.observe("raycap_stream_staleness", behind[1], self.tags)
            self._gauges(waiting, uncommitted)

    def committed(self, output: Any, rollouts: int, rows: int, retired: int, waiting: int) -> None:
        with self._lock:
            self._counts.update(rollouts_committed=rollouts, rows_committed=rows, retired=retired)
            uncommitted = self._counts["rows_delivered"] - self._counts["rows_committed"]
        if metrics.ray_here():
            tags = {"output": "" if output is None else str(output), "capture_dir": self.tags["capture_dir"]}
            metrics.count("raycap_rollouts", rollouts, tags)
            metrics.count("raycap_rows", rows, tags)
            metrics.count("raycap_retired", retired, tags)
            self._gauges(waiting, uncommitted)

    def _gauges(self, waiting: int, uncommitted: int) -> None:
        metrics.gauge("raycap_stream_rollouts_waiting", waiting, self.tags)
        metrics.gauge("raycap_stream_rows_uncommitted", uncommitted, self.tags)

    def as_dict(self, waiting: int) -> dict[str, float]:
        """The figures now, flat, under `raycap/` keys (see the module docstring)."""
        with self._lock:
            counts, masked, latest = dict(self._counts), dict(self._masked), dict(self._latest)
        out: dict[str, float] = {"rollouts_waiting": waiting}
        for key in ("rows_delivered", "rollouts_delivered", "rows_masked", "rows_committed", "rollouts_committed", "retired"):
            out[key] = counts.get(key, 0)
        out["rows_uncommitted"] = out["rows_delivered"] - out["rows_committed"]
        out.update({f"rows_masked/{reason}": n for reason, n in sorted(masked.items())})
        out.update(latest)
        return {PREFIX + key: value for key, value in out.items()}


def pa_scalar(value: int) -> Any:
    import pyarrow as pa

    return pa.scalar(value, pa.int64())
