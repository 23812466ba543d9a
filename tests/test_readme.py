"""Every Python block of README.md runs as written, each in a fresh interpreter.

A block is named by the section (## or ###) it sits in, which is its test's id. An HTML
comment on the line before a block says how it runs:

- `<!-- runs: NAME -->`: the blocks marked NAME are one program, in README order (later
  blocks use what earlier ones defined).
- `<!-- needs: out/demo, ... -->`: the block reads the output `make demo` writes; the
  test writes a small committed output at `out/demo` in the block's directory first.
  `needs: s3, ...`: the block writes to the S3 test server (tests/s3server.py, through
  the AWS_* environment the `s3` fixture sets), in a fresh bucket `raycap-readme`; it
  runs in the slow tier.
- `<!-- not run: REASON -->`: the block is not run, and REASON says why next to it.

Programs that another module already runs (RUN_ELSEWHERE) are left to it, and a fast
test checks that module still has that test. Blocks that use Ray run in the slow tier
(embedded Ray: RAY_ADDRESS is removed); the others run in the fast tier with `ray`
unimportable, so a block that needs Ray without looking like it fails here, not silently
in the fast tier.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT_S = 240

# What marks a block as using Ray (an import, or an API that connects).
USES_RAY = re.compile(r"\bimport ray\b|\bray\.|raycap\.(dataset|token_source|token_sink)\(|refs=True|take_refs|Stream\(|DataParallelFeed")
# Programs whose run, with their own checks, lives in another test module.
RUN_ELSEWHERE = {
    "feeding-a-trainer": ("tests/test_dp_feed.py", "test_the_readme_feeding_example_runs_as_written"),
    "Streaming for asynchronous training": ("tests/test_stream.py", "test_the_readme_streaming_program_runs_as_written"),
}
# What some programs must print, beyond running: the property their section promises.
TRAINING_LOOP = "A training loop: one `Rebuilder`, a rebuild per step"
MARKER = re.compile(r"<!--\s*(runs|needs|not run):\s*(.*?)\s*-->")


@dataclass
class Program:
    """One runnable unit of the README: a block, or the blocks of one `runs:` group."""

    name: str
    section: str
    code: str
    needs: list[str] = field(default_factory=list)
    not_run: str | None = None

    @property
    def uses_ray(self) -> bool:
        return bool(USES_RAY.search(self.code))

    @property
    def elsewhere(self) -> tuple[str, str] | None:
        return RUN_ELSEWHERE.get(self.name)


def readme_programs(text: str) -> list[Program]:
    """The README's Python blocks as programs, in order, named by their section."""
    programs: list[Program] = []
    groups: dict[str, Program] = {}
    per_section: dict[str, int] = {}
    section, markers, lines = "(top)", [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## ") or line.startswith("### "):
            section = line.lstrip("#").strip()
        found = MARKER.search(line)
        if found:
            markers.append((found.group(1), found.group(2)))
        elif line.strip() == "```python":
            end = lines.index("```", i + 1)
            code = "\n".join(lines[i + 1:end]) + "\n"
            kinds = dict(markers)
            if "runs" in kinds and kinds["runs"] in groups:
                groups[kinds["runs"]].code += code
            else:
                per_section[section] = per_section.get(section, 0) + 1
                name = kinds.get("runs") or section
                if per_section[section] > 1 and "runs" not in kinds:
                    name = f"{section} ({per_section[section]})"
                program = Program(name, section, code, [n for k, n in markers if k == "needs"], kinds.get("not run"))
                programs.append(program)
                if "runs" in kinds:
                    groups[kinds["runs"]] = program
            markers, i = [], end
        elif line.strip():
            markers = []  # a marker belongs to the block right after it
        i += 1
    return programs


PROGRAMS = readme_programs(README.read_text(encoding="utf-8"))


def _here(program: Program) -> bool:
    return program.not_run is None and program.elsewhere is None


def _needs(program: Program) -> set[str]:
    return {need.split(",")[0].strip() for need in program.needs}


def _param(program: Program):
    marks = [pytest.mark.slow] if program.uses_ray or "s3" in _needs(program) else []
    return pytest.param(program, id=program.name, marks=marks)


def write_demo_output(directory: Path) -> None:
    """A small committed output where `make demo` puts its own: out/demo."""
    from raycap.handoff import rebuild_to_output
    from raycap.synth import CorpusSpec, generate_corpus

    corpus = generate_corpus(directory / "demo-data", CorpusSpec(rollouts=12, seed=5, system_tokens=(50, 200),
                                                                 generation_tokens=(10, 80), tool_tokens=(10, 80)))
    outcome = rebuild_to_output([corpus.directory], directory / "out" / "demo", executor="local")
    assert outcome.ok, outcome.message


README_BUCKET = "raycap-readme"


def fresh_readme_bucket(_directory: Path) -> None:
    """The bucket the README's object-store block writes to, empty (on the test server
    whose endpoint the `s3` fixture put in the environment)."""
    import boto3

    client = boto3.session.Session().client("s3")
    try:
        client.create_bucket(Bucket=README_BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=README_BUCKET):
            for item in page.get("Contents", []):
                client.delete_object(Bucket=README_BUCKET, Key=item["Key"])


SETUPS = {"out/demo": write_demo_output, "s3": fresh_readme_bucket}


def run_program(program: Program, directory: Path, address: str | None = None) -> subprocess.CompletedProcess:
    """Run a block as a script. With `address`, its Ray calls join that cluster through
    RAY_ADDRESS, as a user's would on a cluster (the code is the README's, unchanged);
    without it, any Ray it starts is embedded."""
    for need in program.needs:
        SETUPS[need.split(",")[0].strip()](directory)
    script = directory / "readme_block.py"
    script.write_text(program.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address is not None:
        env["RAY_ADDRESS"] = address
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if program.uses_ray or "s3" in _needs(program):  # (a block on the S3 server is in the slow tier too)
        command = [sys.executable, str(script)]
    else:
        # `import ray` fails, so a block run in the fast tier cannot start Ray unnoticed.
        runner = "import runpy, sys; sys.modules['ray'] = None; runpy.run_path(sys.argv[1], run_name='__main__')"
        command = [sys.executable, "-c", runner, str(script)]
    return subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("program", [_param(p) for p in PROGRAMS if _here(p)])
def test_the_readme_block_runs_as_written_and_prints_what_it_did(program, tmp_path, request):
    # Blocks that use Ray join the session's cluster instead of each starting its own:
    # the embedded first use is covered by tests/test_session.py and the demo's tests.
    address = request.getfixturevalue("ray_cluster").address if program.uses_ray else None
    if "s3" in _needs(program):
        request.getfixturevalue("s3")  # the test server's endpoint, in the environment the block inherits
    done = run_program(program, tmp_path, address)
    assert done.returncode == 0, f"README block in {program.section!r} failed:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"README block in {program.section!r} prints nothing when run as a script"
    if program.section == TRAINING_LOOP:
        trained, rollouts = map(int, re.search(r"trained on (\d+) rows of (\d+) rollouts", done.stdout).groups())
        assert trained == rollouts > 0  # every step's rows, the last step's included


def test_every_python_block_is_run_here_or_by_a_named_test_or_says_why_not():
    assert len(PROGRAMS) >= 7 and sum(_here(p) for p in PROGRAMS) >= 5
    skipped = [p for p in PROGRAMS if p.not_run is not None]
    assert all(p.not_run for p in skipped) and len(skipped) <= 3
    for program in PROGRAMS:
        if program.elsewhere:
            path, test = program.elsewhere
            assert f"def {test}(" in (ROOT / path).read_text(encoding="utf-8"), f"{program.name}: {path}::{test} is gone"
    for need in {n.split(",")[0].strip() for p in PROGRAMS for n in p.needs}:
        assert need in SETUPS, f"README block needs {need!r}, which this module cannot provide"


def test_the_training_loop_is_one_complete_program_without_top_level_await():
    (loop,) = [p for p in PROGRAMS if p.section == TRAINING_LOOP]
    compile(loop.code, "README training loop", "exec")  # top-level await is a SyntaxError here
    assert "asyncio.run(" in loop.code and _here(loop)


def test_the_quick_start_is_exactly_make_demo_and_make_test():
    text = README.read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.splitlines() if line.startswith("    ")]
    assert commands == ["make demo", "make test"]
    assert re.findall(r"make [\w-]+", quick) == ["make demo", "make test"]
    rest = text.replace(quick, "")
    assert "make test-fast" in rest and "make lint" in rest


def test_the_cluster_section_starts_the_head_with_its_dashboard_as_the_job_submit_test_does():
    text = README.read_text(encoding="utf-8")
    cluster = text.split("### On a cluster", 1)[1].split("\n## ", 1)[0]
    (head,) = [line for line in cluster.splitlines() if "ray start --head" in line]
    assert "--include-dashboard=true" in head and "dashboard" in cluster.split("ray start")[0]
    assert '"--include-dashboard=true"' in (ROOT / "tests" / "test_job_submit.py").read_text(encoding="utf-8")


def test_blocks_are_grouped_named_and_marked_as_the_readme_says():
    text = "\n".join([
        "## One", "```python", "a = 1", "```",
        "<!-- runs: pair -->", "```python", "b = 1", "```", "between",
        "### Two", "<!-- runs: pair -->", "```python", "print(b)", "```",
        "<!-- not run: needs a running cluster -->", "```python", "import ray", "```",
        "<!-- needs: out/demo, the output of make demo -->", "text that separates", "```python", "c = 3", "```",
    ])
    programs = readme_programs(text)
    assert [(p.name, p.section) for p in programs] == [
        ("One", "One"), ("pair", "One"), ("Two", "Two"), ("Two (2)", "Two"),
    ]
    assert programs[1].code == "b = 1\nprint(b)\n"
    assert programs[2].not_run == "needs a running cluster" and programs[2].uses_ray
    assert programs[3].needs == []  # a marker is only the next block's when nothing is between them
