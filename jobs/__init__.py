"""Entry points a training cluster runs: `python -m jobs.<name> --config FILE`.

- `jobs.rebuild`: capture directories in, one durable Parquet dataset out, then retirement;
- `jobs.clear`: delete stale captures of the rollouts about to be dispatched;
- `jobs.sweep`: remove retired tombstones older than a retention period;
- `jobs.demo`: a synthetic corpus through `jobs.rebuild`, for a first look.

Jobs are thin: they read a config (`raycap.jobconfig`), call the library, print what
happened and exit with a status a scheduler can act on:

- 0: done;
- 1: the work ran but part of it failed (the reasons are on stderr); a rerun finishes it;
- 2: the job could not start: bad config, missing capture directory, unwritable, locked
  or conflicting output, an output some building node cannot see, no Ray cluster to
  join. One line on stderr says why;
- 3: (rebuild) the masked share exceeded max_mask_fraction; the reasons are on stderr.

The same config runs locally and under `ray job submit`: with RAY_ADDRESS set (as a
submitted job has) or `ray.address` configured, a job joins that cluster and passes it no
resources; otherwise it starts an embedded Ray sized by `ray.num_cpus`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from raycap.jobconfig import CaptureJobConfig, RayOptions

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_MASKED = 3


def fail(prog: str, message: str, code: int = EXIT_USAGE) -> int:
    """Print the reason as one line on stderr and return the exit status."""
    print(f"{prog}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return code


def parse_config_argument(prog: str, description: str, argv: Sequence[str] | None) -> str:
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("--config", required=True, help="the job's YAML config (see configs/)")
    return parser.parse_args(argv).config


def runs_embedded(options: RayOptions) -> bool:
    """Whether the job will start its own Ray on this machine rather than join a cluster."""
    return not options.address and not os.environ.get("RAY_ADDRESS")


def connect_ray(options: RayOptions) -> None:
    """Join the configured cluster (or RAY_ADDRESS's) or start an embedded Ray."""
    import ray

    from raycap.cluster.rebuild import connect

    if ray.is_initialized():
        return
    if runs_embedded(options):
        connect(None, num_cpus=options.num_cpus)
    else:
        # A submitted job's driver must not pass resources: the cluster already has them.
        connect(options.address or "auto")


class CannotStart(Exception):
    """The job could not start; the message is the one-line reason."""


def ensure_fleet(config: CaptureJobConfig, config_path: str) -> None:
    """Connect and start the actors of the capture directories' nodes, or raise CannotStart.

    A capture directory that does not exist, or an actor that cannot start, is reported
    here, before any work, as a job that could not start. Plain paths are checked on this
    machine first when Ray will run here, which saves starting Ray for a typo."""
    from raycap.cluster.rebuild import fleet

    if runs_embedded(config.ray):
        missing = config.missing_local_dirs()
        if missing:
            raise CannotStart(f"capture directory {missing[0]} does not exist; check capture_dirs in {config_path}")
    try:
        connect_ray(config.ray)
    except ConnectionError as exc:
        raise CannotStart(f"cannot connect to Ray: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any failure to reach Ray stops the job the same way
        where = config.ray.address or os.environ.get("RAY_ADDRESS") or "an embedded Ray"
        raise CannotStart(
            f"cannot connect to {where}: {type(exc).__name__}: {exc}; start the cluster, fix ray.address, "
            "or remove ray.address to run embedded"
        ) from None
    try:
        fleet(config.capture_dirs)
    except (ValueError, TimeoutError) as exc:
        raise CannotStart(str(exc)) from None


def start_fleet(prog: str, config: CaptureJobConfig, config_path: str) -> int | None:
    """`ensure_fleet`, as an exit status (None when it started)."""
    try:
        ensure_fleet(config, config_path)
    except CannotStart as exc:
        return fail(prog, str(exc))
    return None
