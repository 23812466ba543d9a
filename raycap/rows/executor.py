"""Where a request runs: the one decision, made from one description of the request.

`decide` is the only place that chooses between building in this process ("local"),
on Ray, and the cold first-call plan (this process builds alongside Ray's first builder
tasks while their workers start). Every entry asks it: `raycap.rebuild`, the
`Rebuilder`, the dataset writer, the jobs and the demo. Its answer is an
`ExecutorChoice`, the choice and the reason the summary and `Rebuilder.last_executor`
report.

The rules, in order:

- Object refs always come from Ray. "ray" and "local" are obeyed; "local" needs plain
  paths on this machine (ValueError otherwise).
- With no Ray running in this process (auto): local when no cluster is asked for
  (`address`, RAY_ADDRESS) and the captures (at most LOCAL_MAX_BYTES) build here before
  an embedded Ray would have started; a plain path missing on this machine then raises
  FileNotFoundError, since an embedded Ray has no other machine to find it on.
- With Ray running (auto): Ray once this driver's workers are up, for a dataset (builder
  tasks write the shards, the driver only commits) and on a cluster reached by address;
  else, on a single node and a small input, the cold plan.

Retiring and listing ask too (`Request.kind`): a retirement runs here whenever Ray is
neither running nor asked for, whatever the size (it reads shards, not captures).

This module does not import Ray; what it needs to know of Ray comes as a `RayState`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Literal

from raycap.capture.directory import CaptureDir, local_paths, missing_plain_path
from raycap.capture.store import TokenCaptureStore, is_valid_rollout_id
from raycap.rows.options import RebuildOptions

# Below this many bytes of captures, building in this process ends before an embedded
# Ray would have started (see the README's first-call benchmark).
LOCAL_MAX_BYTES = 1 << 30

Kind = Literal["rows", "shards", "refs", "list", "retire"]


@dataclass(frozen=True)
class ExecutorChoice:
    """Which executor ran a call, and why (the job's summary reports it)."""

    executor: str
    reason: str
    # A first call on a running single-node Ray: this process builds alongside it.
    cold: bool = False


@dataclass(frozen=True)
class RayState:
    """What the decision needs to know about Ray in this process."""

    running: bool = False
    alive_nodes: int = 0
    # This driver's builder workers are up: it has built on this Ray, or the session
    # has placed its directories already.
    warm: bool = False


@dataclass(frozen=True)
class Request:
    """One description of a request: the directories, the ids (None: list them), the
    options, what it produces and the cluster asked for."""

    dirs: tuple[CaptureDir, ...]
    rollout_ids: tuple[str, ...] | None
    options: RebuildOptions
    kind: Kind = "rows"
    address: str | None = None
    # Bytes of input besides the captures that the work reads (a results file being
    # finalized), counted with them against LOCAL_MAX_BYTES.
    input_bytes: int = 0

    @property
    def cluster_asked(self) -> bool:
        return bool(self.address or os.environ.get("RAY_ADDRESS"))


def ray_running() -> bool:
    """Whether Ray is initialised in this process (without importing it)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def decide_without_ray(request: Request) -> ExecutorChoice | None:
    """`decide` for `request` in a process where Ray is not running, as a session decides
    there (without loading it); None when Ray is running: a session decides then."""
    return None if ray_running() else decide(request, RayState(running=False))


def listed_ids(paths: tuple[str, ...], skip_retired: bool) -> list[str]:
    """The sorted rollout ids found in any of these local directories."""
    stores = [TokenCaptureStore(path, create=False) for path in paths]
    return sorted({rid for store in stores for rid in store.rollout_ids(skip_retired=skip_retired)})


def capture_bytes(paths: tuple[str, ...], rollout_ids: list[str] | tuple[str, ...], limit: int) -> int:
    """The JSONL bytes of these rollouts over the directories, counted up to `limit`."""
    total = 0
    # Invalid ids hold nothing; each is its own masked row when built.
    valid = [r for r in rollout_ids if is_valid_rollout_id(r)]
    for path in paths:
        total += sum(TokenCaptureStore(path, create=False).held(valid).values())
        if total > limit:
            break
    return total


def decide(request: Request, ray: RayState) -> ExecutorChoice:
    """The executor of `request` (see the module docstring for the rules)."""
    if request.kind == "refs":
        return ExecutorChoice("ray", "object refs were asked for")
    executor = request.options.executor
    if executor == "ray":
        return ExecutorChoice("ray", "executor: ray was asked for")
    local = local_paths(request.dirs)
    if executor == "local":
        if not local.readable:
            raise ValueError(
                f"executor local reads capture directories in this process, but {local.why_not}; use executor ray"
            )
        return ExecutorChoice("local", "executor: local was asked for")
    if request.kind == "retire":
        if not ray.running and not request.cluster_asked and local.readable:
            return ExecutorChoice("local", "no Ray running or asked for: retired from this process")
        return ExecutorChoice("ray", local.why_not or "Ray is running or asked for")
    if not ray.running:
        return _without_ray(request, local.paths if local.readable else None, local.why_not)
    if ray.warm:
        return ExecutorChoice("ray", "Ray is running and this driver's workers are up")
    if request.kind == "shards" or request.cluster_asked:
        return ExecutorChoice("ray", "Ray is running: builder tasks write the rows")
    if not local.readable:
        return ExecutorChoice("ray", local.why_not)
    if ray.alive_nodes > 1:
        # Other nodes may hold directories of their own under these paths.
        return ExecutorChoice("ray", "Ray is running with several nodes")
    total = capture_bytes(local.paths, _ids(request, local.paths), LOCAL_MAX_BYTES)
    if total > LOCAL_MAX_BYTES:
        return ExecutorChoice("ray", f"more than {LOCAL_MAX_BYTES >> 20} MB of captures: Ray's cores pay")
    # The first call on this Ray: its workers would start now. This process builds
    # alongside them; the actors start after it, for the next call.
    return ExecutorChoice(
        "ray",
        f"first call on this Ray: this process built alongside Ray's builder tasks while their "
        f"workers started ({total / 1e6:.1f} MB of captures); the actors start after it",
        cold=True,
    )


def _ids(request: Request, paths: tuple[str, ...]) -> list[str] | tuple[str, ...]:
    if request.rollout_ids is not None:
        return request.rollout_ids
    return listed_ids(paths, request.options.skip_retired)


def _without_ray(request: Request, paths: tuple[str, ...] | None, why_not: str) -> ExecutorChoice:
    """auto's choice when no Ray runs in this process."""
    if request.cluster_asked:
        return ExecutorChoice("ray", why_not or "a Ray cluster address is given, or the input is large")
    missing = missing_plain_path(request.dirs)
    if missing is not None:
        raise FileNotFoundError(
            f"capture directory {missing} does not exist on this machine, and no Ray cluster is running or "
            "given to look for it on; check the path, or pass address= to rebuild on a cluster"
        )
    if paths is None:
        return ExecutorChoice("ray", why_not)
    total = request.input_bytes
    if total <= LOCAL_MAX_BYTES:
        total += capture_bytes(paths, _ids(request, paths), LOCAL_MAX_BYTES - total)
    if total > LOCAL_MAX_BYTES:
        return ExecutorChoice("ray", "a Ray cluster address is given, or the input is large")
    if request.kind == "list":
        return ExecutorChoice("local", "no Ray running or asked for: listed in this process")
    what = "of captures" if not request.input_bytes else "of captures and results"
    return ExecutorChoice(
        "local",
        f"no Ray running or asked for, and {total / 1e6:.1f} MB {what} build in this process "
        "before an embedded Ray would have started",
    )
