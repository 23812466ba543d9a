"""Every Python and shell block of README.md and docs/*.md runs as written, each in a fresh process.

A block is named by its page and the section (#, ## or ###) it sits in, which is its
test's id (`docs/training.md::feeding-a-trainer`). ```` ```python ```` blocks run in a
fresh interpreter, ```` ```sh ```` blocks with bash, with `raycap` on the path as this
checkout's command; indented blocks are illustrations and are not run. An HTML comment
on the line before a block says how it runs:

- `<!-- runs: NAME -->`: the blocks marked NAME on one page are one program, in page
  order (later blocks use what earlier ones defined).
- `<!-- needs: out/demo, ... -->`: the block reads the output `make demo` writes; the
  test writes a small committed output at `out/demo` in the block's directory first.
  `needs: s3, ...`: the block writes to the S3 test server (tests/s3server.py, through
  the AWS_* environment the `s3` fixture sets), in a fresh bucket `raycap-readme`; it
  runs in the slow tier.
- `<!-- not run: REASON -->`: the block is not run, and REASON says why next to it.

Programs that another module already runs (RUN_ELSEWHERE) are left to it, and a fast
test checks that module still has that test. Fast tests also check every relative link
of the pages (the file, and the heading an `#anchor` names) and the README's length. Every
block runs in a fresh interpreter or shell, so all of them are in the slow tier: blocks
that use Ray join the session's cluster (RAY_ADDRESS), the others, and shell blocks, run
where Ray cannot start or be joined (`ray.init` raises), so a block that needs Ray
without looking like it fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The pages whose blocks run: the front door, then every page of docs/.
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 200
TIMEOUT_S = 240

# What marks a block as using Ray (an import, or an API that connects).
USES_RAY = re.compile(r"\bimport ray\b|\bray\.|raycap\.(dataset|token_source|token_sink)\(|refs=True|take_refs|Stream\(|DataParallelFeed")
# Programs whose run, with their own checks, lives in another test module.
# Keyed by (page, program name).
RUN_ELSEWHERE = {
    ("docs/training.md", "feeding-a-trainer"): ("tests/train/test_parallel.py", "test_the_readme_feeding_example_runs_as_written"),
    ("docs/streaming.md", "Streaming for asynchronous training"): (
        "tests/runs/test_stream.py", "test_the_readme_streaming_program_runs_as_written"),
}
# What some programs must print, beyond running: the property their section promises.
TRAINING_LOOP = "A training loop: one `Rebuilder`, a rebuild per step"
HEADING = re.compile(r"^(#{1,3}) (.+)$")
MARKER = re.compile(r"<!--\s*(runs|needs|not run):\s*(.*?)\s*-->")


@dataclass
class Program:
    """One runnable unit of a page: a block, or the blocks of one `runs:` group."""

    name: str
    section: str
    code: str
    needs: list[str] = field(default_factory=list)
    not_run: str | None = None
    page: str = "README.md"
    language: str = "python"

    @property
    def uses_ray(self) -> bool:
        return self.language == "python" and bool(USES_RAY.search(self.code))

    @property
    def elsewhere(self) -> tuple[str, str] | None:
        return RUN_ELSEWHERE.get((self.page, self.name))

    @property
    def id(self) -> str:
        return f"{self.page}::{self.name}"


RUN_LANGUAGES = {"python", "sh"}


def readme_programs(text: str, page: str = "README.md") -> list[Program]:
    """A page's Python and shell blocks as programs, in order, named by their section."""
    programs: list[Program] = []
    groups: dict[str, Program] = {}
    per_section: dict[str, int] = {}
    section, markers, lines = "(top)", [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        heading = HEADING.match(line)
        if heading:
            section = heading.group(2).strip()
        found = MARKER.search(line)
        if found:
            markers.append((found.group(1), found.group(2)))
        elif line.startswith("```"):
            end = lines.index("```", i + 1)
            language = line[3:].strip()
            if language in RUN_LANGUAGES:
                code = "\n".join(lines[i + 1:end]) + "\n"
                kinds = dict(markers)
                if "runs" in kinds and kinds["runs"] in groups:
                    groups[kinds["runs"]].code += code
                else:
                    per_section[section] = per_section.get(section, 0) + 1
                    name = kinds.get("runs") or section
                    if per_section[section] > 1 and "runs" not in kinds:
                        name = f"{section} ({per_section[section]})"
                    needs = [n for k, n in markers if k == "needs"]
                    program = Program(name, section, code, needs, kinds.get("not run"), page, language)
                    programs.append(program)
                    if "runs" in kinds:
                        groups[kinds["runs"]] = program
            markers, i = [], end  # a fence of another language is skipped whole: its lines are no headings
        elif line.strip():
            markers = []  # a marker belongs to the block right after it
        i += 1
    return programs


def _page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


PROGRAMS = [p for page in PAGES for p in readme_programs(page.read_text(encoding="utf-8"), _page_name(page))]


def _here(program: Program) -> bool:
    return program.not_run is None and program.elsewhere is None


def _needs(program: Program) -> set[str]:
    return {need.split(",")[0].strip() for need in program.needs}


def _param(program: Program):
    return pytest.param(program, id=program.id)


def write_demo_output(directory: Path) -> None:
    """A small committed output where `make demo` puts its own: out/demo."""
    from raycap.cli.synth import CorpusSpec, generate_corpus
    from raycap.runs.handoff import rebuild_to_output

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
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address is not None:
        env["RAY_ADDRESS"] = address
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if program.language == "sh":
        return _run_shell(program, directory, env)
    script = directory / "readme_block.py"
    script.write_text(program.code, encoding="utf-8")
    if program.uses_ray or "s3" in _needs(program):  # (a block on the S3 server is in the slow tier too)
        command = [sys.executable, str(script)]
    else:
        command = [sys.executable, str(_fast_tier_runner(directory)), str(script)]
    return subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


# The fast tier's runner: Ray may be imported (raycap's modules import it) but neither
# started nor joined, so a block that needs Ray without looking like it fails here, not
# silently in the fast tier.
FAST_TIER_RUNNER = """
import importlib.abc, importlib.util, runpy, sys

def refuse(*args, **kwargs):
    raise RuntimeError("this block starts or joins Ray, so it belongs to the slow tier: "
                       "say so in the block (import ray), or use executor='local'")

class RayThatCannotStart(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "ray":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("ray")
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                real.exec_module(module)
                module.init = sys.modules["ray._private.worker"].init = refuse

        spec.loader = Loader()
        return spec

sys.meta_path.insert(0, RayThatCannotStart())
if sys.argv[1] == "-m":
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _fast_tier_runner(directory: Path) -> Path:
    runner = directory / ".fast_tier.py"
    runner.write_text(FAST_TIER_RUNNER, encoding="utf-8")
    return runner


def _run_shell(program: Program, directory: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A shell block under `bash -e`, in a fresh directory of its own, with `raycap` on the
    path as this checkout's command, run as the fast tier runs Python blocks."""
    work = directory / "sh"
    (work / ".bin").mkdir(parents=True)
    command = work / ".bin" / "raycap"
    runner = _fast_tier_runner(directory)
    command.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{runner}" -m raycap "$@"\n', encoding="utf-8")
    command.chmod(0o755)
    script = work / ".bin" / "readme_block.sh"
    script.write_text(program.code, encoding="utf-8")
    env = {**env, "PATH": os.pathsep.join([str(command.parent), env.get("PATH", "")])}
    return subprocess.run(["bash", "-e", str(script)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("program", [_param(p) for p in PROGRAMS if _here(p)])
def test_the_readme_block_runs_as_written_and_prints_what_it_did(program, tmp_path, request):
    # Blocks that use Ray join the session's cluster instead of each starting its own:
    # the embedded first use is covered by tests/cluster/test_session.py and the demo's tests.
    address = request.getfixturevalue("ray_cluster").address if program.uses_ray else None
    if "s3" in _needs(program):
        request.getfixturevalue("s3")  # the test server's endpoint, in the environment the block inherits
    done = run_program(program, tmp_path, address)
    assert done.returncode == 0, f"block {program.id!r} failed:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"block {program.id!r} prints nothing when run as a script"
    if program.section == TRAINING_LOOP:
        trained, rollouts = map(int, re.search(r"trained on (\d+) rows of (\d+) rollouts", done.stdout).groups())
        assert trained == rollouts > 0  # every step's rows, the last step's included


def test_every_python_block_is_run_here_or_by_a_named_test_or_says_why_not():
    assert len(PROGRAMS) >= 12 and sum(_here(p) for p in PROGRAMS) >= 10
    assert {p.page for p in PROGRAMS} >= {"README.md", "docs/library.md", "docs/gym-api.md", "docs/jobs-and-cli.md"}
    assert len({p.id for p in PROGRAMS}) == len(PROGRAMS)  # every test id names one program
    skipped = [p for p in PROGRAMS if p.not_run is not None]
    assert all(p.not_run for p in skipped) and len(skipped) <= 3
    for program in PROGRAMS:
        if program.elsewhere:
            path, test = program.elsewhere
            assert f"def {test}(" in (ROOT / path).read_text(encoding="utf-8"), f"{program.id}: {path}::{test} is gone"
    for page, name in RUN_ELSEWHERE:
        assert any((p.page, p.name) == (page, name) for p in PROGRAMS), f"{page} has no program {name!r} to run elsewhere"
    for need in {n.split(",")[0].strip() for p in PROGRAMS for n in p.needs}:
        assert need in SETUPS, f"a block needs {need!r}, which this module cannot provide"


def test_the_training_loop_is_one_complete_program_without_top_level_await():
    (loop,) = [p for p in PROGRAMS if p.section == TRAINING_LOOP]
    compile(loop.code, "README training loop", "exec")  # top-level await is a SyntaxError here
    assert "asyncio.run(" in loop.code and _here(loop)


def test_the_quick_start_is_make_demo_the_test_tiers_and_how_to_reach_the_command():
    text = README.read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.splitlines() if line.startswith("    ")]
    assert commands[:3] == ["make demo", "make test-fast", "make test"]
    assert re.findall(r"make [\w-]+", quick) == ["make demo", "make test-fast", "make test"]
    # After `make demo` the command is in .venv/bin, not on the PATH: the next lines say so.
    assert commands[3:5] == [".venv/bin/raycap inspect out/demo", "source .venv/bin/activate"]
    development = (DOCS / "development.md").read_text(encoding="utf-8")
    assert "make test-fast" in development and "make lint" in development


def test_the_readme_is_a_front_door_of_at_most_200_lines_that_links_every_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    for page in PAGES[1:]:
        assert f"({_page_name(page)}" in text, f"README.md does not link {_page_name(page)}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(text: str) -> list[str]:
    """The lines of a page outside its fenced and indented blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in _prose(path.read_text(encoding="utf-8")):
        heading = HEADING.match(line) or re.match(r"^(#{4,6}) (.+)$", line)
        if heading:
            slug = github_anchor(heading.group(2).replace("`", ""))
            seen[slug] = seen.get(slug, -1) + 1
    return {slug if n == 0 else f"{slug}-{n}" for slug, count in seen.items() for n in range(count + 1)}


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file, or whose #anchor in it, does not exist."""
    broken = []
    for line in _prose(page.read_text(encoding="utf-8")):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
                broken.append(f"{target} (no heading #{anchor})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=_page_name)
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page):
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Two `words`\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md) [ok](a.md#two-words) [ok](#here) [ok](https://x.org/y)\n# Here\n"
                    "[bad](c.md) [bad](a.md#three)\n    [an illustration](d.md)\n", encoding="utf-8")
    assert broken_links(page) == ["c.md (no such file)", "a.md#three (no heading #three)"]


def test_the_cluster_section_starts_the_head_with_its_dashboard_as_the_job_submit_test_does():
    text = (DOCS / "jobs-and-cli.md").read_text(encoding="utf-8")
    cluster = text.split("## On a cluster", 1)[1].split("\n## ", 1)[0]
    (head,) = [line for line in cluster.splitlines() if "ray start --head" in line]
    assert "--include-dashboard=true" in head and "dashboard" in cluster.split("ray start")[0]
    assert '"--include-dashboard=true"' in (ROOT / "tests" / "system" / "test_job_submit.py").read_text(encoding="utf-8")


def test_blocks_are_grouped_named_and_marked_as_the_readme_says():
    text = "\n".join([
        "## One", "```python", "a = 1", "```",
        "<!-- runs: pair -->", "```python", "b = 1", "```", "between",
        "### Two", "<!-- runs: pair -->", "```python", "print(b)", "```",
        "<!-- not run: needs a running cluster -->", "```python", "import ray", "```",
        "<!-- needs: out/demo, the output of make demo -->", "text that separates", "```python", "c = 3", "```",
    ])
    text += "\n" + "\n".join([
        "# Three", "```yaml", "# not a heading", "```", "```sh", "raycap --version", "```",
    ])
    programs = readme_programs(text, "docs/page.md")
    assert [(p.name, p.section) for p in programs] == [
        ("One", "One"), ("pair", "One"), ("Two", "Two"), ("Two (2)", "Two"), ("Three", "Three"),
    ]
    assert programs[1].code == "b = 1\nprint(b)\n"
    assert programs[2].not_run == "needs a running cluster" and programs[2].uses_ray
    assert programs[3].needs == []  # a marker is only the next block's when nothing is between them
    assert programs[4].language == "sh" and programs[4].id == "docs/page.md::Three" and not programs[4].uses_ray
