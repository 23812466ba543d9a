"""Shared test fixtures: one simulated Ray cluster for the whole session, and the tiers.

The tiers:
- `make test-fast` runs every test not marked `slow`: no Ray, no subprocesses, no
  fault injection, nothing that takes seconds on its own, and the property tests with a quarter of their examples
  (`strategies.examples`). A test that asks for a Ray fixture (`ray_shared`, `ray_cluster`,
  `fresh_ray`) is marked slow here, at collection; one that starts Ray without asking
  fails, so the fast tier stays free of Ray.
- `make test` runs everything, every example included, in two processes (pytest-xdist),
  each with its own cluster.

The cluster (`ray.cluster_utils.Cluster`) is started once, on first use, with a 2-CPU
head node, and this process is its driver. Starting Ray is what costs (seconds); a
driver connecting again costs a tenth of a second. So a test that needs a clean slate
(a new Ray job: its own actors, namespace and worker processes) or a job-level runtime
environment connects a fresh driver (`fresh_ray`), and a test that needs several nodes
adds them to the same cluster and removes them afterwards (`ray_cluster.add_node`).
Removed nodes stay listed as dead, and raycap only ever looks at alive nodes.

The head runs with a private Ray temp directory, so the cluster never replaces or
removes the address file of another Ray on this machine, and a `ray start` cluster
elsewhere on the machine is never joined.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Compiled modules are cached, however pytest is started (`make test` unexports
# PYTHONDONTWRITEBYTECODE for the same reason): the suite starts hundreds of Python
# processes (jobs, Ray workers, docs blocks, commands) that inherit this environment, and
# with the variable set each would compile raycap's modules again, and each test process
# would rewrite every test module's asserts again (seconds of CPU per process).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False
# Dummy credentials for the S3 test server, set before any Ray worker starts so that every
# worker has them (a builder task's file system reads them there); the endpoint comes
# with the file system the task receives. Never real AWS: the `s3` fixture sets the
# endpoint of the test server.
for _name, _value in {"AWS_ACCESS_KEY_ID": "raycap-test", "AWS_SECRET_ACCESS_KEY": "raycap-test",
                      "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(_name, _value)

# Ray Data's Parquet listing starts 32 footer-reading actors (new worker processes) for
# each `ray.data.read_parquet` of a directory; on two cores one does the tests' small
# outputs in a fifth of the time. (raycap.dataset reads its listed shards without them.)
os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
# A raylet starts worker processes for waiting tasks and actors up to this many at a time
# (Ray's default: the node's CPUs). A burst of short zero-CPU tasks (a docs block's eight
# writers, say) then starts a process for each, each importing Ray and raycap for a task
# that takes milliseconds; one at a time, the first workers are free again before most of
# the others would have started. On two cores that is a sixth of a docs run's CPU.
os.environ.setdefault("RAY_worker_maximum_startup_concurrency", "1")

import pytest  # noqa: E402 - the variables above must be set before anything imports Ray

SHARED_RAY_CPUS = 2
SHARED_OBJECT_STORE_BYTES = 256 << 20
NODE_OBJECT_STORE_BYTES = 100 << 20
HEAD_LABEL = "head"  # the `raycap-node` label of the driver's node

# Asking for one of these puts a test in the slow tier (the S3 ones need the test server).
RAY_FIXTURES = frozenset({"ray_shared", "ray_cluster", "fresh_ray"})
S3_FIXTURES = frozenset({"s3", "s3_bucket"})


# The longest test files of the full run by name (unique across tests/ and its folders),
# longest first (per-file sums of --durations on 2 cores). `make test` keeps a file on one
# process (--dist loadfile) and hands the files out in collection order: these go first, so
# the short files are what is left at the end and the two processes finish together.
# (xdist's own order, most tests first, leaves the files of one or two long tests, such as
# test_console and test_job_submit, to the end, where the other process waits for them.)
# A stale list costs balance, never a test.
LONGEST_FIRST = (
    "test_objectstore.py", "test_docs_blocks.py", "test_install.py", "test_command.py", "test_pool.py",
    "test_job_submit.py", "test_cluster_faults.py", "test_worker.py", "test_nodestream.py", "test_job_processes.py",
    "test_clusters_in_turn.py", "test_stream.py", "test_console.py", "test_rebuilder.py", "test_finalizer.py",
    "test_readers.py", "test_connect.py", "test_rollouts.py", "test_ray_sink.py", "test_misuse.py",
    "test_multinode.py", "test_placement.py", "test_parallel.py", "test_actor.py", "test_session.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    for item in items:
        if (RAY_FIXTURES | S3_FIXTURES).intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    # A stable sort on the file alone: each file's tests stay together and in their order.
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def _fast_tests_start_no_ray(request):
    """A test outside the slow tier that leaves Ray running started it: say so."""
    if request.node.get_closest_marker("slow") is not None or _ray_running():
        yield
        return
    yield
    if _ray_running():
        sys.modules["ray"].shutdown()
        pytest.fail(f"{request.node.nodeid} started Ray: ask for `ray_shared` (the slow tier) or mark it slow")


class RayCluster:
    """The session's simulated cluster and this process's connection to it."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        # Short: Ray's socket paths under it must fit.
        self.temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")
        self._runtime_env: dict | None = None
        with self._private_temp_dir():
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": SHARED_RAY_CPUS,
                    "object_store_memory": SHARED_OBJECT_STORE_BYTES,
                    "include_dashboard": False,
                    "labels": {"raycap-node": HEAD_LABEL},
                },
            )

    @property
    def address(self) -> str:
        return self.cluster.address

    @contextmanager
    def _private_temp_dir(self):
        # Only while nodes start: subprocess jobs the tests run keep the machine's default.
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_TMPDIR", self.temp_dir)
            patch.delenv("RAY_ADDRESS", raising=False)
            yield

    def connected(self) -> bool:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address

    def connect(self, runtime_env: dict | None = None, *, fresh: bool = False) -> None:
        """Make this process the cluster's driver, with `runtime_env` for the job; a
        new driver (a new Ray job) when `fresh` or when the environment differs."""
        import ray

        if not fresh and self.connected() and self._runtime_env == runtime_env:
            return
        ray.shutdown()
        ray.init(address=self.address, logging_level=logging.WARNING, runtime_env=runtime_env)
        self._runtime_env = runtime_env

    def add_node(self, num_cpus: int = 1, labels: dict[str, str] | None = None) -> Any:
        """A worker node (its `ray._private.node.Node`), alive when this returns."""
        with self._private_temp_dir():
            node = self.cluster.add_node(
                num_cpus=num_cpus, object_store_memory=NODE_OBJECT_STORE_BYTES, labels=labels or {}
            )
        self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node: Any) -> None:
        if node in self.cluster.worker_nodes:
            self.cluster.remove_node(node)

    @contextmanager
    def nodes(self, labels: list[dict[str, str]]):
        """Worker nodes with these labels for the duration of the block, removed after it."""
        added = []
        try:
            for node_labels in labels:
                added.append(self.add_node(labels=node_labels))
            yield added
        finally:
            for node in added:
                self.remove_node(node)

    def node_ids(self) -> dict[str, str]:
        """The alive nodes' ids by their `raycap-node` label."""
        import ray

        return {n["Labels"]["raycap-node"]: n["NodeID"] for n in ray.nodes() if n["Alive"] and "raycap-node" in n["Labels"]}

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's RayCluster, started on first use (this process not yet connected)."""
    if _ray_running():
        sys.modules["ray"].shutdown()  # a Ray a fast test left behind is not ours to join
    cluster = RayCluster()
    yield cluster
    cluster.shutdown()


@pytest.fixture
def ray_shared(ray_cluster):
    """This process connected to the shared cluster as its plain driver (2 CPUs on the
    driver's node, 256 MB object store): the same driver across tests."""
    ray_cluster.connect()
    yield ray_cluster


@pytest.fixture
def fresh_ray(ray_cluster):
    """connect(runtime_env=None): a new driver (Ray job) on the shared cluster for this
    test alone, with its own actors and worker processes; let go after the test."""
    import ray

    def connect(runtime_env: dict | None = None) -> RayCluster:
        ray_cluster.connect(runtime_env, fresh=True)
        return ray_cluster

    yield connect
    ray.shutdown()


# --- an S3 API (moto's server, over HTTP): see tests/s3server.py -----------------------------------


class S3Server:
    """The session's S3 test server: its endpoint, and a boto3 client of it."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        self.endpoint = endpoint
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def new_bucket(self) -> str:
        import uuid

        name = f"raycap-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key of the bucket under `prefix`, sorted."""
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found.extend(item["Key"] for item in page.get("Contents", []))
        return sorted(found)


@pytest.fixture(scope="session")
def s3():
    """The S3 test server: the one `make test` started (its endpoint in the environment),
    or one of this session's own, stopped at its end. The endpoint is exported as
    AWS_ENDPOINT_URL for the session (subprocess jobs inherit it)."""
    import s3server

    endpoint = os.environ.get(s3server.ENDPOINT_VARIABLE)
    process = None
    if not endpoint:
        process, endpoint = s3server.start()
    wanted = s3server.environment(endpoint)
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield S3Server(endpoint)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if process is not None:
            s3server.stop(process)


@pytest.fixture
def s3_bucket(s3):
    """A new bucket of the test server for this test alone: its name."""
    return s3.new_bucket()


def on_ray(*args, **kwargs):
    """`raycap.rebuild` on Ray (executor "auto" would build a session's first call, or
    a small input, in this process): for the tests of the Ray delivery itself."""
    import raycap

    return raycap.rebuild(*args, executor="ray", **kwargs)


# --- capture directories -----------------------------------------------------------------------


def write_entries(directory: str | Path, entries) -> str:
    """A capture directory holding `entries` (created if need be), as a path string."""
    from raycap.capture.store import TokenCaptureStore

    store = TokenCaptureStore(directory)
    for entry in entries:
        store.append(entry)
    return str(directory)



def capture_states(directory: str | Path) -> dict[str, dict]:
    """The state file of every rollout in a capture directory, by rollout id."""
    suffix = ".tokens.state.json"
    return {p.name[: -len(suffix)]: json.loads(p.read_text()) for p in Path(directory).glob("*" + suffix)}


def retired_ids(directory: str | Path) -> set[str]:
    return {rid for rid, state in capture_states(directory).items() if state.get("retired")}


def frozen_ids(directory: str | Path) -> set[str]:
    return {rid for rid, state in capture_states(directory).items() if state.get("frozen")}


def driver_waits(monkeypatch, module: Any, wait) -> None:
    """The finalizing driver's own runner (`module.local_finalizer`) calls `wait()` before
    each batch it computes, so that the runners beside it take batches too."""
    local = module.local_finalizer

    def waiting(context, *rest):
        runner = local(context, *rest)
        hand = runner.hand

        def after_wait(batch, data):
            wait()
            return hand(batch, data)

        runner.hand = after_wait
        return runner

    monkeypatch.setattr(module, "local_finalizer", waiting)


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
    from raycap.cli.synth import CorpusSpec, generate_corpus

    directory = tmp_path_factory.mktemp("fault-corpus") / "src"
    return generate_corpus(directory, CorpusSpec(rollouts=40, seed=3, **FAULT_SPEC_KWARGS))


@pytest.fixture
def corpus_copy(fault_corpus, tmp_path):
    """copy(name) -> path of a fresh copy of the fault corpus under this test's tmp dir."""

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


@pytest.fixture
def collection(fault_corpus, tmp_path):
    """A results file over a copy of the fault corpus with every case NeMo Gym's finalizer
    tells apart: (captures, an untouched copy of them for the oracle, results file, its
    records); see tests/collection.py."""
    from collection import write_collection

    return write_collection(fault_corpus, tmp_path)
