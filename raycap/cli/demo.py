"""`python -m jobs.demo` (what `make demo` runs): raycap end to end in a couple of minutes.

Writes a small synthetic corpus (40 rollouts with realistic token sizes but fewer turns,
15% of them given a fault shape: retries, branches, damaged files, ...) into the capture
directory of `configs/demo.yaml`, then runs `jobs.rebuild` with that config on an
embedded Ray and prints its summary: which rollouts were masked and why, how much of the
generated text reaches training, and what was retired.

Every run starts fresh: the corpus and the previous outputs are replaced. The demo marks
the directory it writes, and refuses to replace a non-empty directory without that mark,
so pointing the demo config at real captures never deletes them; it removes an output
only when the output's manifest says it was built from that corpus alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from raycap.cli import rebuild as rebuild_job
from raycap.cli.jobconfig import ConfigError, RebuildJobConfig, load_config
from raycap.cli.jobs import EXIT_OK, executor_choice, fail, job_logging
from raycap.cli.synth import CorpusSpec, generate_corpus
from raycap.output.commit import summary_path
from raycap.output.faults import OutputError
from raycap.output.manifest import read_manifest

PROG = "jobs.demo"
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"  # the repository's configs/
MARKER = ".raycap-demo"
DEMO_SPEC = CorpusSpec(rollouts=40, turns=(4, 12), fault_share=0.15)


def _fresh_corpus(directory: Path, spec: CorpusSpec) -> str | None:
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
    (directory / MARKER).write_text("written by `python -m jobs.demo`; replaced on every demo run\n")
    print(f"{PROG}: {summary.line()}", flush=True)
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


def _chain_delivery_preview(config: RebuildJobConfig, corpus: str, verbose: bool):
    """Rebuild the same corpus with chain delivery (nothing retired) to compare the
    generated tokens each delivery hands to training. Freezing is idempotent, so the main
    run that follows sees the same snapshots."""
    output = config.output.with_name(config.output.name + "-chains")
    error = _remove_demo_output(output, corpus)
    if error:
        print(f"{PROG}: skipping the chain-delivery preview: {error}", flush=True)
        return None
    preview = config.model_copy(
        update={"delivery": "chains", "retire": False, "output": output, "max_mask_fraction": None}
    )
    print(f"{PROG}: first, the same corpus with delivery: chains (output {output}):", flush=True)
    with job_logging(verbose):
        outcome, status = rebuild_job.run(preview, verbose=verbose)
    return outcome.summary if status == EXIT_OK else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEMO_CONFIG), help="rebuild config to run (default: configs/demo.yaml)")
    parser.add_argument("--rollouts", type=int, default=DEMO_SPEC.rollouts, help="rollouts to synthesise")
    parser.add_argument("--verbose", action="store_true", help="log every masked rollout in detail (see jobs.rebuild)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        config = load_config(args.config, RebuildJobConfig)
    except ConfigError as exc:
        return fail(PROG, str(exc))
    plain = [d for d in config.capture_dirs if d.node is None]
    if not plain:
        return fail(PROG, f"the demo writes its corpus into the first plain capture directory of {args.config}; it has none")
    # The demo is a single-machine run: its corpus exists only here.
    os.environ.pop("RAY_ADDRESS", None)

    error = _fresh_corpus(Path(plain[0].path), replace(DEMO_SPEC, rollouts=args.rollouts))
    if error:
        return fail(PROG, error)
    # The new corpus has the same inputs as the last one: a kept output would be reused.
    error = _remove_demo_output(config.output, plain[0].label)
    if error:
        return fail(PROG, error)

    choice = executor_choice(config, config.executor, config.rollout_ids)
    where = f"(executor: {config.executor}, runs {choice.executor}: {choice.reason})"
    if choice.executor == "ray":
        where = "on an embedded Ray (starting it takes a few seconds)"
    print(f"{PROG}: rebuilding with {args.config} {where}", flush=True)
    chains_summary = _chain_delivery_preview(config, plain[0].label, args.verbose)
    status = rebuild_job.main(["--config", str(args.config)] + (["--verbose"] if args.verbose else []))
    if chains_summary is not None and chains_summary.rollout_delivery_tokens is not None:
        gained = chains_summary.generated_tokens_delivered - chains_summary.rollout_delivery_tokens
        print(
            f"{PROG}: chain delivery (delivery: chains) would train on {chains_summary.generated_tokens_delivered:,} "
            f"generated tokens in {chains_summary.rows:,} chains, against "
            f"{chains_summary.rollout_delivery_tokens:,} for rollout delivery: {gained:+,} tokens recovered "
            "from branches, compactions and side calls."
        )
    elapsed = time.monotonic() - started
    if status == EXIT_OK:
        print(
            f"{PROG}: done in {elapsed:.0f} s. Rows: {config.output}, a Parquet dataset directory, one row per "
            "rollout (pyarrow.parquet.read_table or raycap.dataset read it; raycap.builds_from_table turns rows "
            f"back into build dicts); summary: {summary_path(config.output)}; masked rollouts keep their captures "
            f"in {plain[0].path}."
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
