"""The one executor dispatch (`raycap.runs.dispatch`): every entry asks it, and what runs
in this process never loads Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from raycap.capture.directory import capture_dirs
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.rows.executor import Request
from raycap.rows.options import RebuildOptions
from raycap.runs import dispatch

PACKAGE = Path(dispatch.__file__).resolve().parents[1]


@pytest.fixture
def captures(tmp_path):
    spec = CorpusSpec(rollouts=3, turns=(4, 4), system_tokens=(8, 8), fault_share=0.0)
    generate_corpus(str(tmp_path / "captures"), spec)
    return str(tmp_path / "captures")


def test_a_request_for_this_process_gets_the_local_executor_and_runs_there(captures):
    dirs = capture_dirs([captures])
    runner, choice = dispatch.executor_for(Request(dirs, None, RebuildOptions(executor="local"), "rows"))
    assert isinstance(runner, dispatch.Local) and choice.executor == "local"
    run = runner.run(None, RebuildOptions(executor="local"), choice=choice)
    assert sum(table.num_rows for table in run) == 3 and run.choice is choice
    assert runner.list_rollouts() == ["r0000", "r0001", "r0002"]


def _importers_of(target: str) -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == target:
                found.add(path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", "."))
    return found


def test_only_the_dispatch_and_the_rebuilder_reach_the_ray_session_from_outside_ray():
    # The command line's jobs connect and place ahead of their work: not an entry's dispatch.
    outside = {m for m in _importers_of("raycap.cluster.rebuild.session") if not m.startswith(("raycap.cluster.", "raycap.cli."))}
    assert outside == {"raycap.runs.dispatch", "raycap.runs.rebuilder"}, outside
    assert {m for m in _importers_of("raycap.cluster.finalizer") if not m.startswith("raycap.cluster.")} == {"raycap.runs.dispatch"}


LOCAL_STREAM_AND_RETIREMENT = """
import sys
import raycap
from raycap.cli.synth import CorpusSpec, generate_corpus

work = sys.argv[1]
spec = CorpusSpec(rollouts=4, turns=(4, 4), system_tokens=(8, 8), fault_share=0.0)
generate_corpus(f"{work}/a", spec)
with raycap.Stream([f"{work}/a"]) as stream:
    stream.submit(["r0000", "r0001"])
    rows = stream.take(2, timeout=60)
    report = stream.commit(rows, output=f"{work}/steps/step-0")
assert report.retired == 2, report
generate_corpus(f"{work}/b", spec)
outcome = raycap.rebuild_to_output([f"{work}/b"], f"{work}/out", model="m")
retired = raycap.retire([f"{work}/b"], f"{work}/out")
assert retired.dropped == 4, retired
print("ray" in sys.modules)
"""


@pytest.mark.slow
def test_a_local_stream_and_a_local_retirement_do_not_import_ray(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", LOCAL_STREAM_AND_RETIREMENT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]


ENTRIES = {
    "rebuild": (["captures"],),
    "rebuild_to_output": (["captures"], "out"),
    "finalize_rollouts": (["captures"], [], "out"),
    "Rebuilder": (["captures"],),
    "Stream": (["captures"],),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_every_option_an_entry_takes_reaches_its_rebuild_options(entry, monkeypatch):
    """The entries make their options with `RebuildOptions.of` from their arguments:
    every option keyword they take arrives there by name, none restated on the way."""
    import dataclasses
    import inspect

    import raycap

    function = getattr(raycap, entry)
    fields = {f.name for f in dataclasses.fields(RebuildOptions)}
    taken = [name for name in inspect.signature(function).parameters if name in fields]
    assert {"builder", "executor"} <= set(taken)
    seen: list[dict] = []

    class Stop(Exception):
        pass

    def of(cls, arguments):
        seen.append(dict(arguments))
        raise Stop

    monkeypatch.setattr(RebuildOptions, "of", classmethod(of))
    marked = {name: object() for name in taken}
    with pytest.raises(Stop):
        function(*ENTRIES[entry], **marked)
    assert {name: seen[0][name] for name in taken} == marked
