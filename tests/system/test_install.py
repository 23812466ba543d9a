"""raycap as a user installs it: a wheel in a fresh virtual environment, run from an empty folder.

The wheel is built from a copy of the package (the checkout is not written to), installed
with its dependencies into a new venv by uv (its cache makes that a few seconds), and
every command runs with that venv's `raycap`, from a folder outside the checkout, with
no PYTHONPATH: a file the wheel does not ship fails here. One venv serves the module.
Each command must write only where it is pointed: the test compares the folders before
and after.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_job_submit import JOB_TIMEOUT_S, head_of

REPO = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).with_name("uv")

pytestmark = pytest.mark.slow


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the venv's bin folder, an environment that runs it and nothing of the checkout)."""
    if not UV.exists():
        pytest.skip("uv is not installed next to this interpreter (make setup installs it)")
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copytree(REPO / "raycap", source / "raycap", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}
    run = lambda *args: subprocess.run(  # noqa: E731
        [str(UV), *args], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    run("build", "--wheel", "--out-dir", str(root / "dist"), str(source))
    run("venv", "--python", sys.executable, str(root / "venv"))
    run("pip", "install", "--python", str(root / "venv" / "bin" / "python"), *map(str, (root / "dist").glob("*.whl")))
    bin_dir = root / "venv" / "bin"
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0")
    return bin_dir, env


def _raycap(installed, cwd: Path, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    bin_dir, environ = installed
    env = env or environ
    return subprocess.run([str(bin_dir / "raycap"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_installed_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    bin_dir, env = installed
    where = subprocess.run([str(bin_dir / "python"), "-c", "import raycap; print(raycap.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert "site-packages" in where.stdout and str(REPO) not in where.stdout


def test_the_commands_run_from_an_empty_folder_and_write_only_where_pointed(installed, tmp_path):
    site = Path(subprocess.run([str(installed[0] / "python"), "-c", "import raycap; print(raycap.__file__)"],
                               env=installed[1], capture_output=True, text=True, timeout=120).stdout.strip()).parent
    package_before, checkout_before = _tree(site), _tree(REPO / "raycap")
    work = tmp_path / "work"
    work.mkdir()

    # The demo writes into the current folder: demo-data/ and out/, nothing else.
    demo = _raycap(installed, work, "demo", "--rollouts", "8")
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert sorted(p.name for p in work.iterdir()) == ["demo-data", "out"]
    assert demo.stdout.count("  rollouts ") == 1  # one summary block
    # ... or into a folder given.
    elsewhere = _raycap(installed, work, "demo", str(tmp_path / "there"), "--rollouts", "4", "-q")
    assert elsewhere.returncode == 0 and elsewhere.stdout == "", elsewhere.stderr[-3000:]
    assert (tmp_path / "there" / "out" / "demo").is_dir()

    # inspect, with --json; a closed pipe ends it quietly.
    inspected = _raycap(installed, work, "inspect", "out/demo", "--json")
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["rows"] == 8 and report["png"] in (str(work / "out" / "demo.lengths.png"), None)
    bin_dir, env = installed
    piped = subprocess.run(["bash", "-c", "raycap inspect out/demo --no-png --bins 5000 | head -1; echo ${PIPESTATUS[0]}"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert piped.stdout.splitlines()[-1] == "141" and piped.stderr == "", piped.stderr

    # rebuild by flags, finalize by a config printed by `raycap config`.
    assert _raycap(installed, work, "synth", "caps", "--rollouts", "5", "-q").returncode == 0
    rebuilt = _raycap(installed, work, "rebuild", "caps", "--output", "steps/one", "--executor", "local", "--json")
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert json.loads(rebuilt.stdout)["summary"]["rollouts"] == 5
    assert _raycap(installed, work, "synth", "caps2", "--rollouts", "3", "-q").returncode == 0
    (work / "rollouts.jsonl").write_text("".join(json.dumps({"_ng_rollout_id": f"r{i:04d}"}) + "\n" for i in range(3)))
    example = _raycap(installed, work, "config", "finalize")
    assert example.returncode == 0 and example.stdout.startswith("#")
    config = yaml.safe_load(example.stdout)
    config.update(capture_dirs=["caps2"], results="rollouts.jsonl", output="steps/finalized", executor="local")
    (work / "finalize.yaml").write_text(yaml.safe_dump(config))
    finalized = _raycap(installed, work, "finalize", "--config", "finalize.yaml", "--json")
    assert finalized.returncode == 0, finalized.stderr[-3000:]
    assert json.loads(finalized.stdout)["summary"]["records"]["records"] == 3

    # Nothing was written into the installed package or the checkout.
    assert _tree(site) == package_before and _tree(REPO / "raycap") == checkout_before
    assert not (REPO / "raycap" / "configs" / "demo-data").exists()


def test_ray_job_submit_runs_the_installed_command_without_a_checkout(installed, corpus_copy, tmp_path):
    """`ray job submit -- raycap rebuild ...` on a cluster whose nodes have raycap
    installed: no working directory is shipped. clear and sweep join the same cluster."""
    bin_dir, environ = installed
    captures = corpus_copy("captures")
    output = tmp_path / "out" / "step-1"
    config = tmp_path / "rebuild.yaml"
    config.write_text(yaml.safe_dump({"capture_dirs": [captures], "output": str(output), "retire": True}))
    with head_of(bin_dir / "ray", tmp_path / "head.log", environ) as (url, env, gcs, _):
        submit = [str(bin_dir / "ray"), "job", "submit", "--address", url, "--", "raycap", "rebuild", "--config",
                  str(config)]
        done = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        assert "snapshots dropped" in done.stdout
        summary = json.loads(output.with_name("step-1.summary.json").read_text())
        assert summary["executor"]["name"] == "ray" and summary["retired"]["dropped"] > 0

        records = tmp_path / "dispatch.jsonl"
        records.write_text(json.dumps({"_ng_rollout_id": "nothing-here"}) + "\n")
        cleared = _raycap(installed, tmp_path, "clear", captures, "--records", str(records), "--address", gcs, "--json", env=env)
        assert cleared.returncode == 0, cleared.stderr[-3000:]
        assert json.loads(cleared.stdout)["cleared"] == 1
        sweep = tmp_path / "sweep.yaml"
        sweep.write_text(yaml.safe_dump({"capture_dirs": [captures], "older_than_seconds": 0, "ray": {"address": gcs}}))
        swept = _raycap(installed, tmp_path, "sweep", "--config", str(sweep), "--json", env=env)
        assert swept.returncode == 0, swept.stderr[-3000:]
        assert json.loads(swept.stdout)["total"] >= summary["retired"]["dropped"]
