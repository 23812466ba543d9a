"""raycap's figures as `raycap_*` series through Ray's metrics API (`ray.util.metrics`).

A figure is recorded only in a process where Ray runs (initialised here), so a run
without Ray never imports Ray for it; its summary holds the same figures. Each metric
object is made once per process, on its first record, and recorded per batch or per
step (never per row or token). Ray's metrics agent on each node exports them at the
node's Prometheus endpoint (`ray start --metrics-export-port=N`: http://NODE:N/metrics)
with Ray's prefix: in Ray 2.60 a counter `raycap_rows` is the series
`ray_raycap_rows_total`, a gauge `raycap_stream_rollouts_waiting` is
`ray_raycap_stream_rollouts_waiting`, a histogram `raycap_commit_seconds` is
`ray_raycap_commit_seconds_bucket`/`_sum`/`_count`. Ray adds the tags SessionName,
NodeAddress (the node), WorkerId (the recording process) and Component; raycap adds
`output`, `capture_dir` (the run's directories, comma-separated), and where it means
something `reason` (a mask reason) or `stage`. `METRICS` lists every one.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Mapping

from raycap.observe.timing import BATCH_STAGES

_RUN = ("output", "capture_dir")
_SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0]
_VERSIONS = [0.5, 1.5, 2.5, 3.5, 4.5, 8.5, 16.5, 32.5]

# name: (kind, description, tag keys)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "raycap_rollouts": ("counter", "Rollouts written to an output (rebuild, finalize, a stream's commit)", _RUN),
    "raycap_rows": ("counter", "Rows written to an output (chains in chain delivery)", _RUN),
    "raycap_rows_masked": ("counter", "Masked rows written to an output", _RUN),
    "raycap_rows_masked_by_reason": (
        "counter", "Masked rows written, by mask reason (a row counts once per distinct reason)", _RUN + ("reason",),
    ),
    "raycap_tokens_captured": ("counter", "Generated tokens of the rows built", _RUN),
    "raycap_tokens_delivered": ("counter", "Generated tokens of the unmasked rows written", _RUN),
    "raycap_bytes_read": ("counter", "Capture bytes the batches read", _RUN),
    "raycap_bytes_written": ("counter", "Bytes of the shard files written", _RUN),
    "raycap_batch_seconds": ("histogram", "Seconds a batch spent per stage (freeze, read, build, write)", _RUN + ("stage",)),
    "raycap_commit_seconds": ("histogram", "Seconds of an output's commit", _RUN),
    "raycap_retired": ("counter", "Snapshots retired (dropped) after their rows were committed", _RUN),
    "raycap_retire_errors": ("counter", "Snapshots that could not be retired", _RUN),
    "raycap_stream_rollouts_waiting": ("gauge", "Rollouts ready or built ahead, not taken yet", ("capture_dir",)),
    "raycap_stream_rows_uncommitted": ("gauge", "Rows a stream delivered that no commit has claimed", ("capture_dir",)),
    "raycap_stream_rows_delivered": ("counter", "Rows a stream delivered (taken)", ("capture_dir",)),
    "raycap_stream_rows_masked_by_reason": (
        "counter", "Masked rows a stream delivered, by mask reason", ("capture_dir", "reason"),
    ),
    "raycap_stream_freeze_to_take_seconds": (
        "histogram", "Seconds from a rollout becoming ready (frozen) to its take", ("capture_dir",),
    ),
    "raycap_stream_staleness": (
        "histogram", "Policy versions a taken row is behind the trainer's (its version_min)", ("capture_dir",),
    ),
}
_BOUNDARIES = {"raycap_stream_staleness": _VERSIONS}

_made: dict[str, Any] = {}
_lock = threading.Lock()


def ray_here() -> bool:
    """Whether Ray is initialised in this process (checked without importing it)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _metric(name: str) -> Any:
    metric = _made.get(name)
    if metric is not None:
        return metric
    with _lock:
        if name not in _made:
            from ray.util import metrics

            kind, description, tags = METRICS[name]
            if kind == "counter":
                _made[name] = metrics.Counter(name, description=description, tag_keys=tags)
            elif kind == "gauge":
                _made[name] = metrics.Gauge(name, description=description, tag_keys=tags)
            else:
                bounds = _BOUNDARIES.get(name, _SECONDS)
                _made[name] = metrics.Histogram(name, description=description, boundaries=bounds, tag_keys=tags)
        return _made[name]


def count(name: str, value: float, tags: Mapping[str, str]) -> None:
    """Add `value` to counter `name` (nothing without Ray, or for zero)."""
    if value and ray_here():
        _metric(name).inc(value, tags=dict(tags))


def gauge(name: str, value: float, tags: Mapping[str, str]) -> None:
    if ray_here():
        _metric(name).set(value, tags=dict(tags))


def observe(name: str, value: float, tags: Mapping[str, str]) -> None:
    if ray_here():
        _metric(name).observe(value, tags=dict(tags))


def run_tags(output: Any, capture_dirs: Any) -> dict[str, str]:
    """The tags of a run's series: its output, and its directories' labels."""
    labels = [str(getattr(d, "label", d)) for d in capture_dirs]
    return {"output": str(output), "capture_dir": ",".join(labels)}


class RunMeter:
    """A run's figures as its shards arrive in the driver (`shard`), recorded as series
    where Ray runs, and kept for the summary: the batches' stage seconds (`clock`),
    the capture bytes read, and the masked rows so far (shown by `progress`)."""

    def __init__(self, tags: Mapping[str, str], clock: Any, progress: Any = None) -> None:
        self.tags, self.clock, self.progress = dict(tags), clock, progress
        self.bytes_read = 0
        self.masked = 0
        if progress is not None and hasattr(progress, "masked"):
            progress.masked = 0

    def shard(self, info: Any) -> None:
        """One shard written (a `raycap.output.shards.ShardInfo`, with the figures of
        the batch that wrote it)."""
        if info is None or not hasattr(info, "stats"):
            return
        stats, figures = info.stats, getattr(info, "figures", None) or {}
        self.clock.add_batch(figures)
        read = int(figures.get("bytes_read", 0))
        self.bytes_read += read
        self.masked += stats.masked
        if self.progress is not None and hasattr(self.progress, "masked"):
            self.progress.masked = self.masked
        if not ray_here():
            return
        tags = self.tags
        count("raycap_rollouts", stats.rollouts, tags)
        count("raycap_rows", stats.rows, tags)
        count("raycap_rows_masked", stats.masked, tags)
        for reason, n in stats.masked_by_reason.items():
            count("raycap_rows_masked_by_reason", n, {**tags, "reason": reason})
        count("raycap_tokens_captured", stats.tokens_captured, tags)
        count("raycap_tokens_delivered", stats.tokens_delivered, tags)
        count("raycap_bytes_read", read, tags)
        count("raycap_bytes_written", info.file_bytes, tags)
        for stage in BATCH_STAGES:
            if stage in figures:
                observe("raycap_batch_seconds", figures[stage], {**tags, "stage": stage})

    def committed(self, seconds: float) -> None:
        self.clock.add("commit", seconds)
        observe("raycap_commit_seconds", seconds, self.tags)

    def retired(self, dropped: int, errors: int) -> None:
        count("raycap_retired", dropped, self.tags)
        count("raycap_retire_errors", errors, self.tags)
