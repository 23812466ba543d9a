"""The one executor dispatch: where a request runs, decided once, and what runs it there.

The rules are `raycap.rows.executor.decide`'s. `choose` applies them for every entry: with
no Ray running in this process it decides here, without importing Ray; with Ray running,
the directories' Ray session says what it knows of Ray (an executor named explicitly
needs no session to decide). `executor_for` hands the request to what runs it: `Local`
(this process) or the cached Ray session of the directories (`raycap.cluster.rebuild.session`).
Both take the same calls (`run`, `list_rollouts`), so an entry never branches on the
executor past this module. A request that runs in this process never imports Ray.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from raycap.capture.directory import CaptureDir
from raycap.capture.directory import capture_dirs as parse_capture_dirs
from raycap.finalize.batch import FinalizedBatch
from raycap.finalize.pool import finalize_pooled, here_context, local_finalizer
from raycap.finalize.results import ResultsScan
from raycap.finalize.worker import worker_processes
from raycap.finalize.worker import workers as pool_workers
from raycap.output.shards import shard_writer
from raycap.rows.executor import ExecutorChoice, RayState, Request, decide, decide_without_ray
from raycap.rows.local import Progress, iter_local, local_ids
from raycap.rows.options import RebuildOptions
from raycap.rows.run import Run


class Local:
    """This process as an executor: the calls of a Ray session, made here without Ray."""

    def __init__(self, dirs: tuple[CaptureDir, ...]) -> None:
        self.dirs = dirs

    def run(
        self,
        rollout_ids: Sequence[str] | None,
        options: RebuildOptions,
        *,
        progress: Callable[[Progress], None] | None = None,
        shard_dir: Any = None,
        choice: ExecutorChoice,
    ) -> Run:
        """A call's results in row order, built here (shards kept, as a session keeps them)."""
        run = Run(choice, progress)
        source = iter_local(self.dirs, rollout_ids, options, write=shard_writer(shard_dir), progress=run.progress)
        return run.start(source, keep=shard_dir is not None)

    def list_rollouts(self, *, skip_retired: bool = False, executor: str = "auto") -> list[str]:
        """The sorted rollout ids with capture files in any of the directories."""
        return local_ids(self.dirs, None, skip_retired)


def ray_session(dirs: tuple[CaptureDir, ...], address: str | None) -> Any:
    """The cached Ray session of these directories (Ray is imported here, and only here)."""
    from raycap.cluster.rebuild.session import session

    return session(dirs, address=address)


def choose(request: Request, on_ray: Callable[[], Any] | None = None) -> ExecutorChoice:
    """The executor of `request`, decided once (see the module docstring). `on_ray` gives
    the Ray session a caller keeps (a `Rebuilder`), else the directories' cached one."""
    choice = decide_without_ray(request)
    if choice is not None:
        return choice
    if request.options.executor != "auto":
        return decide(request, RayState(running=True))  # asked for: no session is needed to decide
    session = on_ray() if on_ray is not None else ray_session(request.dirs, request.address)
    return decide(request, session.ray_state())


def executor_for(
    request: Request, choice: ExecutorChoice | None = None, on_ray: Callable[[], Any] | None = None
) -> tuple[Any, ExecutorChoice]:
    """What runs `request`, and the choice (`choice` when the caller made it already):
    `Local`, or the Ray session (`on_ray`'s, else the directories' cached one)."""
    choice = choice or choose(request, on_ray)
    if choice.executor == "local":
        return Local(request.dirs), choice
    return (on_ray() if on_ray is not None else ray_session(request.dirs, request.address)), choice


def here_or_on_ray(request: Request) -> Any:
    """What a request whose choice may wait runs on: `Local` when it runs here without
    Ray, else the Ray session, which decides when it is asked (a retirement decides
    once the output is checked)."""
    choice = decide_without_ray(request)
    if choice is not None and choice.executor == "local":
        return Local(request.dirs)
    return ray_session(request.dirs, request.address)


def parsed_dirs(specs: Any) -> tuple[CaptureDir, ...]:
    """Directory specs as parsed values (parsed ones pass as they are)."""
    if isinstance(specs, tuple) and all(isinstance(d, CaptureDir) for d in specs):
        return specs
    return parse_capture_dirs(specs)


def finalize_batches(
    choice: ExecutorChoice, scan: ResultsScan, dirs: Sequence[CaptureDir], options: RebuildOptions,
    fields: tuple[tuple[str, str], ...], staging: Any, *, address: str | None, forks: bool, keep_lines: bool = False,
) -> Iterator[FinalizedBatch]:
    """The batches of a results file finalized where `choice` says: here, beside worker
    processes (`_finalize_here`), or by tasks on Ray (`raycap.cluster.finalizer`). With
    `keep_lines`, the batches this process finalizes keep their lines for a records file's
    draft."""
    if choice.executor == "local":
        return _finalize_here(scan, dirs, options, fields, staging, pool_workers(scan, forks), forks, keep_lines)
    from raycap.cluster.finalizer import finalize_on_ray

    return finalize_on_ray(scan, dirs, options, fields, staging, address=address, forks=forks, keep_lines=keep_lines)


def _finalize_here(
    scan: ResultsScan, dirs: Sequence[CaptureDir], options: RebuildOptions, fields: tuple[tuple[str, str], ...], staging: Any,
    count: int, forks: bool, keep_lines: bool = False,
) -> Iterator[FinalizedBatch]:
    """Each batch of `scan`, finalized in this process as a task would, each written while
    the next is computed, with `count` worker processes finalizing batches too
    (`raycap.finalize.pool`; forks of this process where `forks` and it is safe). (Its
    freezes are not made ahead on a thread: a thread waiting on fsyncs behind a busy
    interpreter waits for the interpreter lock after each, which costs more than it
    overlaps.) With `keep_lines`, this process's reports keep their lines for the records
    file's draft."""
    context = here_context(dirs, scan.label, options, fields, staging)
    start = worker_processes(count, context, scan.label, forks, hand_lines=keep_lines) if count else list
    return finalize_pooled(scan, start, local_finalizer(context, keep_lines))
