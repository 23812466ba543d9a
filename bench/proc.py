"""Benchmark runs in fresh processes: what a user pays from `python` to rows, by executor.

Every run here is a new Python process, so Ray and every import start cold, exactly as
a user's script or job starts. Each run gets its own copy of the corpus, because the
first freeze writes state and a second run would read a different directory.

  fresh_process   connect(num_cpus) + raycap.rebuild: the time until rows are back and
                  until the process has exited (Ray shutdown included)
  first_call      connect(num_cpus), then the first raycap.rebuild of the process and
                  two more on other copies, each timed inside the process, with the
                  executor that ran each ("/cold": a session's first call on a running
                  Ray, which also builds in the calling process)
  end_to_end      `import raycap; raycap.rebuild([copy], executor=E)`, nothing else
  local_cpu       one in-process build (executor local): the CPU time of the build alone
  RayHead         a `ray start --head` cluster of its own, for jobs that join a cluster
  run_job         `python -m jobs.rebuild --config ...` against it: the driver process's
                  own CPU time (wait4 on that one process) and peak RSS (its VmHWM)

The head runs `ray start --head --block` with a private temp directory and free ports,
so it neither joins nor disturbs any other Ray on the machine, and is stopped through
its own process (SIGTERM makes `--block` shut its processes down), then by its process
group. `ray stop` is not used: it stops every Ray process on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")
HEAD_START_TIMEOUT_S = 120.0
CHILD_TIMEOUT_S = 900.0


def fresh_copy(corpus: Path, work: Path, name: str) -> Path:
    target = work / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(corpus, target)
    os.sync()  # the copy's writeback must not land inside the next timed run
    return target


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)  # an embedded Ray unless the caller names a cluster
    env.update(extra)
    return env


def _python(script: str, *args: str) -> list[str]:
    return [sys.executable, "-c", script, *args]


@dataclass
class ChildRun:
    """One child process: wall times, its own CPU and peak RSS, and what it printed."""

    rows_back: float  # seconds until the first line of output
    exited: float  # seconds until the process was reaped
    cpu: float  # user + sys of the child (and any children it waited for), from wait4
    own_cpu: float  # user + sys of the child alone, sampled from /proc
    max_rss: int  # bytes: VmHWM, the peak RSS of the process
    lines: list[str]


class _Watch:
    """The peak RSS (VmHWM) and own CPU time of one process, read from /proc while it runs.

    Not ru_maxrss: Linux folds the pre-exec memory of a forked child (this process's,
    which may hold a reference build's rows) into the child's ru_maxrss, while VmHWM
    belongs to the exec'd program alone. Both readings only grow, so the last one is
    the value up to one interval before exit. The CPU reading counts the process alone,
    never the children it reaps (an embedded Ray's processes)."""

    def __init__(self, pid: int, interval: float = 0.02):
        self.pid, self.interval = pid, interval
        self.peak, self.cpu = 0, 0.0
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _read(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{self.pid}/status", "rb") as fh:
                hwm = next((int(line.split()[1]) * 1024 for line in fh if line.startswith(b"VmHWM:")), None)
        except (OSError, ValueError, IndexError):
            return False
        if hwm is None:
            return False  # a zombie: its memory is gone
        self.peak = max(self.peak, hwm)
        self.cpu = max(self.cpu, (int(fields[11]) + int(fields[12])) / self._tick)  # utime, stime
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._read() and self.peak:
                return
            self._stop.wait(self.interval)

    def stop(self) -> "_Watch":
        self._stop.set()
        self._thread.join()
        return self


def _run(argv: list[str], env: dict[str, str], *, cwd: Path | None = None, what: str, expect: int = 0) -> ChildRun:
    """Run a child to its end, timing its first output line and its exit; an exit
    status other than `expect` raises.

    The child is reaped with wait4, so its CPU time is that process's (and of the
    children it waited for), never another child's of this process."""
    err = tempfile.TemporaryFile()
    start = time.perf_counter()
    child = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=err)
    watch = _Watch(child.pid)
    first = child.stdout.readline()
    rows_back = time.perf_counter() - start
    rest = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    exited = time.perf_counter() - start
    watch.stop()
    child.returncode = os.waitstatus_to_exitcode(status)
    child.stdout.close()
    if child.returncode != expect:
        err.seek(0)
        tail = err.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"{what} failed (exit {child.returncode}):\n{tail}")
    err.close()
    lines = (first + rest).decode().splitlines()
    return ChildRun(rows_back, exited, usage.ru_utime + usage.ru_stime, watch.cpu, watch.peak, lines)


_FRESH = """
import sys
import raycap
from raycap.cluster.rebuild.session import connect
connect(num_cpus=int(sys.argv[2]))
table = raycap.rebuild([sys.argv[1]])
print(table.num_rows, flush=True)
"""


def fresh_process(corpus: Path, cpus: int) -> tuple[float, float]:
    """(seconds until the rows are back, seconds until the process has exited)."""
    run = _run(_python(_FRESH, str(corpus), str(cpus)), _env(), what="the fresh-process rebuild")
    if not run.lines or not run.lines[0].strip().isdigit():
        raise RuntimeError(f"the fresh-process rebuild printed no row count: {run.lines[:3]}")
    return run.rows_back, run.exited


_FIRST_CALL = """
import json, sys, time
t0 = time.perf_counter()
import raycap
from raycap.cluster.rebuild.session import connect, session
imported = time.perf_counter()
connect(num_cpus=int(sys.argv[1]))
connected = time.perf_counter()
executor, dirs = sys.argv[2], sys.argv[3:]
calls = []
for i, d in enumerate(dirs):
    start = time.perf_counter()
    table = raycap.rebuild([d], executor=executor)
    seconds = time.perf_counter() - start
    ran = session([d])
    choice = ran.last_executor
    label = choice.executor + ("/cold" if getattr(choice, "cold", False) else "")
    calls.append({"seconds": seconds, "rows": table.num_rows, "executor": label})
    if i == 0:
        # A first call may start the session's actors in the background, for the next
        # call; let them come up, so that the calls after it are the warm ones.
        warming = getattr(ran, "_warming", None)
        if warming is not None:
            warming.join(60)
print(json.dumps({"import": imported - t0, "connect": connected - imported, "calls": calls}), flush=True)
"""


@dataclass
class FirstCall:
    ray_start: float
    first: float
    warm: list[float]
    executors: list[str]
    rows: list[int]


def first_call(dirs: list[Path], cpus: int, executor: str) -> FirstCall:
    """In a fresh process with Ray started: the first rebuild, then the warm ones."""
    run = _run(
        _python(_FIRST_CALL, str(cpus), executor, *map(str, dirs)), _env(), what=f"the first-call run ({executor})"
    )
    out = json.loads(run.lines[-1])
    calls = out["calls"]
    return FirstCall(
        out["connect"],
        calls[0]["seconds"],
        [c["seconds"] for c in calls[1:]],
        [c["executor"] for c in calls],
        [c["rows"] for c in calls],
    )


_END_TO_END = """
import sys
import raycap
table = raycap.rebuild([sys.argv[1]], executor=sys.argv[2])
print(table.num_rows, flush=True)
if "ray" not in sys.modules:
    print("local", flush=True)  # built here without even loading Ray
else:
    from raycap.cluster.rebuild.session import session
    choice = session([sys.argv[1]]).last_executor
    print(choice.executor + ("/cold" if getattr(choice, "cold", False) else ""), flush=True)
"""


@dataclass
class EndToEnd:
    rows_back: float
    exited: float
    rows: int
    executor: str


def end_to_end(corpus: Path, executor: str) -> EndToEnd:
    """`import raycap; raycap.rebuild([corpus], executor=...)` in a new process."""
    run = _run(_python(_END_TO_END, str(corpus), executor), _env(), what=f"the end-to-end run ({executor})")
    return EndToEnd(run.rows_back, run.exited, int(run.lines[0]), run.lines[1].strip())


_LOCAL_CPU = """
import json, sys, time
import raycap
rebuilder = raycap.Rebuilder([sys.argv[1]], executor="local")
cpu, wall = time.process_time(), time.perf_counter()
table = rebuilder.rebuild()
print(json.dumps({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall, "rows": table.num_rows}))
"""


def local_cpu(corpus: Path) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, rows) of one in-process build, imports left out."""
    run = _run(_python(_LOCAL_CPU, str(corpus)), _env(), what="the in-process build")
    out = json.loads(run.lines[-1])
    return out["cpu"], out["wall"], out["rows"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HeadUnavailable(RuntimeError):
    """`ray start --head` did not come up here."""


class RayHead:
    """A `ray start --head --block` cluster of its own, stopped on exit."""

    def __init__(self, cpus: int, object_store_bytes: int = 1 << 30):
        self.cpus, self.object_store_bytes = cpus, object_store_bytes
        self.address = ""
        self._head: subprocess.Popen | None = None
        self._temp = ""
        self._log: Path | None = None

    def __enter__(self) -> "RayHead":
        # Short: Ray's socket paths under the temp directory must fit in 107 bytes.
        self._temp = tempfile.mkdtemp(prefix="raycap-bench-")
        self._log = Path(self._temp + ".log")
        argv = [
            str(RAY), "start", "--head", "--block",
            f"--port={_free_port()}",
            f"--num-cpus={self.cpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={self._temp}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
            f"--object-store-memory={self.object_store_bytes}",
        ]
        with open(self._log, "wb") as log:
            self._head = subprocess.Popen(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        current = Path(self._temp) / "ray_current_cluster"
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while not current.exists() or not current.read_text().strip():
            if self._head.poll() is not None or time.monotonic() > deadline:
                tail = self._log.read_text(errors="replace")[-2000:]
                self.__exit__(None, None, None)
                raise HeadUnavailable(f"`ray start --head` did not come up: {tail.strip().splitlines()[-1:]}")
            time.sleep(0.2)
        self.address = current.read_text().strip()
        return self

    def env(self) -> dict[str, str]:
        """The environment of a driver that joins this head (as under `ray job submit`)."""
        # This Ray version's local clusters use token authentication: a driver sends the
        # token (~/.ray/auth_token) only in token mode.
        return _env(RAY_ADDRESS=self.address, RAY_AUTH_MODE="token")

    def __exit__(self, *exc) -> None:
        head = self._head
        if head is not None:
            if head.poll() is None:
                head.send_signal(signal.SIGTERM)
                try:
                    head.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(head.pid, signal.SIGKILL)  # anything of this head's session still running
            except ProcessLookupError:
                pass
            head.wait(timeout=30)
        shutil.rmtree(self._temp, ignore_errors=True)
        if self._log is not None:
            self._log.unlink(missing_ok=True)


@dataclass
class JobRun:
    cpu: float  # the driver process's own user + sys seconds
    max_rss: int  # the driver process's peak RSS, bytes
    wall: float
    rows: int
    executor: str  # as the job's summary reports it


def _job_config(path: Path, capture_dir: Path, output: Path, cpus: int | None) -> None:
    from raycap.cli.jobconfig import RebuildJobConfig

    config = {"capture_dirs": [str(capture_dir)], "output": str(output), "model": "bench", "retire": False}
    if "executor" in RebuildJobConfig.model_fields:
        config["executor"] = "ray"
    if cpus is not None:
        config["ray"] = {"address": None, "num_cpus": cpus}
    path.write_text(yaml.safe_dump(config))


def run_job(head: RayHead | None, capture_dir: Path, work: Path, name: str, cpus: int) -> JobRun:
    """`python -m jobs.rebuild --config` as users run it, joined to `head` (the builders
    run in the head's workers), or with head None on an embedded Ray of its own.
    Measured on the driver process alone: with a head, from wait4; embedded, from /proc
    (wait4 would add the Ray processes the driver reaps at shutdown)."""
    from raycap.output.commit import summary_path
    from raycap.output.manifest import read_manifest

    output = work / f"{name}-out"
    for stale in (output, summary_path(output)):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)
    config = work / f"{name}.yaml"
    _job_config(config, capture_dir, output, None if head is not None else cpus)
    run = _run(
        [sys.executable, "-m", "jobs.rebuild", "--config", str(config)],
        head.env() if head is not None else _env(),
        cwd=REPO,
        what=f"the rebuild job on {capture_dir}",
    )
    summary = json.loads(summary_path(output).read_text())
    executor = (summary.get("executor") or {}).get("name", "?")
    cpu = run.cpu if head is not None else run.own_cpu
    return JobRun(cpu, run.max_rss, run.exited, read_manifest(output).totals.rows, executor)
