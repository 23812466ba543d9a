"""Ray failures as the one-line texts of masked rows.

Ray wraps what went wrong in task names, tracebacks and actor details; a masked row's
`error` needs the one line that says why, with the original exception's type, and
whether rebuilding later is safe (it is whenever nothing was dropped). `is_lost` tells a
failure that means a directory's actor or node is gone, whatever wrapper it comes in.
"""

from __future__ import annotations

from typing import Sequence

import ray


def cause_text(exc: BaseException) -> str:
    """"<Type>: <reason>" of a Ray failure, with the original exception's type: Ray's
    wrappers put task names, tracebacks and actor details around the one line that
    says why."""
    name, text = type(exc).__name__, str(exc)
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        name = type(cause).__name__
        if str(cause).strip():
            text = str(cause)
        else:
            text = "\n".join(text.splitlines()[1:])  # the first line names the task and pid
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return name
    # An actor failure ends with the reason ("... killed by `ray.kill`", the creation
    # task's exception); anything else starts with it.
    reason = lines[-1] if isinstance(exc, ray.exceptions.RayActorError) else lines[0]
    return f"{name}: {reason}"


SAFE_LATER = "nothing was dropped, so rebuilding these rollouts later is safe"

# Failures that mean a directory's actor or node is gone, whatever wrapper they come in.
_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnschedulableError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.WorkerCrashedError,
)


def lost_node_error(labels: Sequence[str], nodes: Sequence[str]) -> str:
    where = ", ".join(labels)
    ids = ", ".join(f"{node[:12]}.." for node in dict.fromkeys(nodes))
    return f"NodeDiedError: the node ({ids}) serving capture directory {where} is gone; {SAFE_LATER}"


def is_lost(exc: BaseException) -> bool:
    cause = getattr(exc, "cause", None)
    return isinstance(exc, _LOST) or isinstance(cause, _LOST)


def output_fault(exc: BaseException) -> BaseException | None:
    """The OutputWriteError a builder task raised writing its shard, if that is what
    `exc` is: the output's file system failed, which fails the run instead of becoming
    masked rows (committed, they would be reused and never rebuilt)."""
    from raycap.output.faults import OutputWriteError

    for candidate in (exc, getattr(exc, "cause", None)):
        if isinstance(candidate, OutputWriteError):
            return OutputWriteError(str(candidate))
    return None
