"""Shared test fixtures: one embedded Ray instance for the tests that need Ray.

`ray_shared` starts it on first use and again after a test shut Ray down (the fault
tests run their own clusters), so test order does not matter. It always starts a
private instance (address="local"): a `ray start` cluster elsewhere on the machine is
never joined.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402

SHARED_RAY_CPUS = 2
SHARED_OBJECT_STORE_BYTES = 256 << 20


def start_shared_ray() -> None:
    """Start the shared embedded Ray instance unless one is running."""
    import ray

    if ray.is_initialized():
        return
    ray.init(
        address="local",
        num_cpus=SHARED_RAY_CPUS,
        include_dashboard=False,
        object_store_memory=SHARED_OBJECT_STORE_BYTES,
        logging_level=logging.WARNING,
    )


def on_ray(*args, **kwargs):
    """`raycap.rebuild` on Ray (executor "auto" would build a session's first call, or
    a small input, in this process): for the tests of the Ray delivery itself."""
    import raycap

    return raycap.rebuild(*args, executor="ray", **kwargs)


@pytest.fixture
def ray_shared():
    """A running embedded Ray (2 CPUs, 256 MB object store), shared across tests."""
    start_shared_ray()
    yield


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_exit():
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


# --- a small corpus covering every fault shape ------------------------------------------

FAULT_SPEC_KWARGS = dict(
    fault_share=1.0,
    system_tokens=(50, 200),
    turns=(4, 8),
    generation_tokens=(1, 40),
    tool_tokens=(1, 60),
)


@pytest.fixture(scope="session")
def fault_corpus(tmp_path_factory):
    """A pristine capture directory (CorpusSummary) whose 40 rollouts cover every fault
    shape twice. Freezing mutates a directory, so tests work on copies (`corpus_copy`)."""
    from raycap.synth import CorpusSpec, generate_corpus

    directory = tmp_path_factory.mktemp("fault-corpus") / "src"
    return generate_corpus(directory, CorpusSpec(rollouts=40, seed=3, **FAULT_SPEC_KWARGS))


@pytest.fixture
def corpus_copy(fault_corpus, tmp_path):
    """copy(name) -> path of a fresh copy of the fault corpus under this test's tmp dir."""
    import shutil

    def copy(name: str) -> str:
        target = tmp_path / name
        shutil.copytree(fault_corpus.directory, target)
        return str(target)

    return copy


def _comparable(build: dict | None, directory: str) -> tuple[dict | None, int | None]:
    """A build without its random snapshot id, and with `directory` in error texts
    replaced by "<dir>", plus its snapshot version (which must match between runs)."""
    if build is None:
        return None, None
    out = dict(build)
    snapshot = out.pop("_capture_snapshot", None)
    if out.get("error") and directory:
        out["error"] = out["error"].replace(str(directory), "<dir>")
    return out, (snapshot or {}).get("version")


@pytest.fixture(scope="session")
def comparable():
    """comparable(build, directory) -> (build without snapshot id, snapshot version)."""
    return _comparable
