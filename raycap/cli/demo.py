"""`raycap demo [DIR]` (what `make demo` runs, as `python -m jobs.demo`): raycap end to end in about ten seconds.

Writes a small synthetic corpus (40 rollouts with realistic token sizes but fewer turns,
15% of them given a fault shape: retries, branches, damaged files, ...) into
DIR/demo-data, then rebuilds it into DIR/out/demo on an embedded Ray with the packaged
demo config (`raycap config demo`; DIR is the current folder unless given, and the
config's relative paths are taken from it), and prints one summary: which rollouts were
masked and why, how much of the generated text reaches training, and what was retired.
With `--config FILE`, that file's paths are used, taken from its own folder as for every
job. Nothing is written anywhere else.

Every run starts fresh: the corpus and the previous outputs are replaced. The demo marks
the directory it writes, and refuses to replace a non-empty directory without that mark,
so pointing the demo config at real captures never deletes them; it removes an output
only when the output's manifest says it was built from that corpus alone.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from raycap.cli import rebuild as rebuild_job
from raycap.cli.jobconfig import ConfigError, RebuildJobConfig, load_job_config
from raycap.cli.jobs import (
    EXIT_OK,
    CommandParser,
    Console,
    add_console_flags,
    executor_choice,
    exit_table,
    interrupted,
    job_logging,
)
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.output.commit import summary_path
from raycap.output.faults import OutputError
from raycap.output.manifest import read_manifest

PROG = "jobs.demo"
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"  # shipped in the package
MARKER = ".raycap-demo"
DEMO_SPEC = CorpusSpec(rollouts=40, turns=(4, 12), fault_share=0.15)


def _fresh_corpus(directory: Path, spec: CorpusSpec, console: Console) -> str | None:
    """Write the corpus into an empty directory; an error text if the directory is not ours."""
    if directory.exists():
        if (directory / MARKER).exists():
            shutil.rmtree(directory)
        elif any(directory.iterdir()):
            return (
                f"{directory} is not empty and was not written by the demo; refusing to replace it: "
                "empty it or point capture_dirs in the demo config elsewhere"
            )
    summary = generate_corpus(directory, spec)
    (directory / MARKER).write_text("written by `raycap demo`; replaced on every demo run\n")
    console.say(f"{console.prog}: {summary.line()}")
    return None


def _remove_demo_output(output: Path, corpus: str) -> str | None:
    """Remove an output the demo built from its own corpus (the new corpus has the same
    inputs, so it would be reused); an error text for anything else at that path."""
    if not output.exists():
        summary_path(output).unlink(missing_ok=True)
        return None
    try:
        built_from = read_manifest(output).inputs.get("capture_dirs")
    except OutputError:
        built_from = None
    if built_from != [corpus]:
        return (
            f"{output} was not built by the demo from {corpus}; refusing to replace it: "
            "move it away or point output in the demo config elsewhere"
        )
    shutil.rmtree(output)
    summary_path(output).unlink(missing_ok=True)
    return None


def _raycap_command() -> str:
    """How this shell reaches the `raycap` of this interpreter: `raycap` when it is on the
    PATH, else its path (`.venv/bin/raycap` after `make demo` in a checkout)."""
    script = Path(sys.executable).parent / "raycap"
    found = shutil.which("raycap")
    if not script.exists() or (found is not None and Path(found).resolve() == script.resolve()):
        return "raycap"
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else str(script)


def _chain_delivery_preview(config: RebuildJobConfig, corpus: str, verbose: bool, console: Console):
    """Rebuild the same corpus with chain delivery (nothing retired, no summary shown) to
    compare the generated tokens each delivery hands to training. Freezing is
    idempotent, so the main run that follows sees the same snapshots."""
    output = config.output.with_name(config.output.name + "-chains")
    error = _remove_demo_output(output, corpus)
    if error:
        console.say(f"{console.prog}: skipping the chain-delivery preview: {error}")
        return None
    preview = config.model_copy(
        update={"delivery": "chains", "retire": False, "output": output, "max_mask_fraction": None}
    )
    console.say(f"{console.prog}: first, the same corpus with delivery: chains (output {output})")
    outcome, status = rebuild_job.run(preview, verbose=verbose, console=Console(console.prog, quiet=True), show=False)
    return outcome.summary if status == EXIT_OK else None


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    parser = CommandParser(
        prog=prog if prog.startswith("raycap") else f"python -m {prog}", description=__doc__.splitlines()[0].split(": ", 1)[1],
        epilog=exit_table(),
    )
    parser.add_argument(
        "dir", nargs="?", default=".", metavar="DIR",
        help="the folder to write demo-data/ and out/ into (not used with --config)",
    )
    parser.add_argument(
        "--config", help="a rebuild config to run instead of the packaged one (`raycap config demo` prints it)"
    )
    parser.add_argument("--rollouts", type=int, default=DEMO_SPEC.rollouts, help="rollouts to synthesise")
    add_console_flags(parser, "log every masked rollout in detail (see raycap rebuild --help)")
    args = parser.parse_args(argv)
    console = Console(prog, quiet=args.quiet, json=args.json, command="demo")
    started = time.monotonic()
    if args.rollouts < 0:
        return console.finish(console.fail(f"--rollouts must be at least 0, not {args.rollouts}"))
    config_path = args.config or str(DEMO_CONFIG)
    base = None if args.config else Path(args.dir).resolve()
    if base is not None and base.exists() and not base.is_dir():
        return console.finish(console.fail(f"{args.dir} is not a folder; give the folder to write the demo into"))
    try:
        config = load_job_config(config_path, RebuildJobConfig, base_dir=base)
    except ConfigError as exc:
        return console.finish(console.fail(str(exc)))
    plain = [d for d in config.capture_dirs if d.node is None]
    if not plain:
        return console.finish(console.fail(
            f"the demo writes its corpus into the first plain capture directory of {config_path}; it has none"
        ))
    # The demo is a single-machine run: its corpus exists only here.
    os.environ.pop("RAY_ADDRESS", None)
    with job_logging(args.verbose):
        try:
            return _run(config, plain[0], args, console, started)
        except KeyboardInterrupt:
            return console.finish(interrupted(console, config.output))


def _run(config: RebuildJobConfig, corpus, args, console: Console, started: float) -> int:
    try:
        error = _fresh_corpus(Path(corpus.path), replace(DEMO_SPEC, rollouts=args.rollouts), console)
    except OSError as exc:
        error = f"cannot write the demo corpus into {corpus.path}: {exc.strerror or exc}; choose a writable folder"
    if error:
        return console.finish(console.fail(error))
    # The new corpus has the same inputs as the last one: a kept output would be reused.
    error = _remove_demo_output(config.output, corpus.label)
    if error:
        return console.finish(console.fail(error))

    choice = executor_choice(config, config.executor, config.rollout_ids)
    where = f"(executor: {config.executor}, runs {choice.executor}: {choice.reason})"
    if choice.executor == "ray":
        where = "on an embedded Ray (starting it takes a few seconds)"
    console.say(f"{console.prog}: rebuilding {corpus.path} into {config.output} {where}")
    chains_summary = _chain_delivery_preview(config, corpus.label, args.verbose, console)
    outcome, status = rebuild_job.run(config, config_path=args.config or "the demo config", verbose=args.verbose,
                                      console=console)
    chains = None
    if chains_summary is not None and chains_summary.rollout_delivery_tokens is not None:
        gained = chains_summary.generated_tokens_delivered - chains_summary.rollout_delivery_tokens
        chains = {"rows": chains_summary.rows, "generated_tokens_delivered": chains_summary.generated_tokens_delivered,
                  "rollout_delivery_tokens": chains_summary.rollout_delivery_tokens}
        console.say(
            f"{console.prog}: chain delivery (delivery: chains) would train on {chains_summary.generated_tokens_delivered:,} "
            f"generated tokens in {chains_summary.rows:,} chains, against "
            f"{chains_summary.rollout_delivery_tokens:,} for rollout delivery: {gained:+,} tokens recovered "
            "from branches, compactions and side calls."
        )
    elapsed = time.monotonic() - started
    if status == EXIT_OK:
        console.say(
            f"{console.prog}: done in {elapsed:.0f} s. Rows: {config.output}, a Parquet dataset directory, one row per "
            "rollout (pyarrow.parquet.read_table or raycap.dataset read it; raycap.builds_from_table turns rows "
            f"back into build dicts); summary: {summary_path(config.output)}; masked rollouts keep their captures "
            f"in {corpus.path}. Next: {_raycap_command()} inspect {config.output}"
        )
    return console.finish(
        status, output=str(config.output), corpus=corpus.path, seconds=round(elapsed, 1),
        summary=None if outcome is None else outcome.summary.to_json(), chains=chains,
    )


if __name__ == "__main__":
    sys.exit(main())
