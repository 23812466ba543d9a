"""Synthetic capture corpora: realistic agentic-RL rollouts written as capture directories.

A corpus is a directory in the on-disk capture format, written through
`TokenCaptureStore` exactly as a model server would write it, so everything downstream
(freeze, builders, the cluster pipeline, benchmarks) reads it like a real capture.

A normal rollout is one agent conversation of 4-40 turns whose calls chain by token
prefix (`raycap.cli.conversation`). A configurable share of rollouts gets one *shape*
from `SHAPES` (`raycap.cli.shapes`); shapes that damage a file write to it directly, as
an external writer or a crash would, bypassing the store's index; the store recovers or
reports them when the rollout is frozen.

Everything is a function of the seed: the same spec writes the same bytes (apart from
the random snapshot ids the store gives frozen rollouts).
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from raycap.capture.records import TokenEntry, entry_line
from raycap.capture.store import TokenCaptureStore
from raycap.cli.conversation import _Conversation, _ModelCall, _Template
from raycap.cli.shapes import LONG, NORMAL, SHAPES, _plan

_ROLLOUT_ID_PREFIX = re.compile(r"[A-Za-z0-9._-]*")


@dataclass(frozen=True)
class CorpusSpec:
    """What to generate. Ranges are inclusive (low, high) token or turn counts."""

    rollouts: int = 120
    seed: int = 0
    system_tokens: tuple[int, int] = (1000, 3000)
    turns: tuple[int, int] = (4, 40)
    generation_tokens: tuple[int, int] = (30, 700)
    tool_tokens: tuple[int, int] = (20, 1200)
    vocab_size: int = 151_936  # token ids in [0, vocab_size - 1]
    fault_share: float = 0.1  # share of rollouts given a shape from SHAPES
    id_prefix: str = "r"
    model: str = "Qwen/Qwen2.5-7B-Instruct"


@dataclass(frozen=True)
class CorpusSummary:
    """What was written: rollout ids in order, the shape of each, calls and bytes."""

    directory: str
    rollout_ids: tuple[str, ...]
    shapes: Mapping[str, str]  # rollout id -> shape name (NORMAL, LONG or one of SHAPES)
    calls: int  # model calls made, whether or not their record landed intact
    bytes_written: int  # on-disk size of the rollouts' files afterwards

    def line(self) -> str:
        faulted = sum(1 for shape in self.shapes.values() if shape in SHAPES)
        return (
            f"wrote {len(self.rollout_ids)} rollouts ({faulted} shaped), {self.calls} calls, "
            f"{self.bytes_written / 1e6:.1f} MB to {self.directory}"
        )


# ----------------------------------------------------------------------------- writing


def _record(rollout_id: str, model: str, call: _ModelCall) -> TokenEntry:
    values = {
        "schema_version": call.schema_version,
        "rollout_id": rollout_id,
        "model_call_id": call.call_id,
        "model": model,
        "prompt_token_ids": call.prompt.tolist(),
        "generation_token_ids": call.generation.tolist(),
        "generation_log_probs": call.log_probs.tolist(),
        "routed_experts": call.routed_experts,
        "output_items": call.output_items,
        "token_item_index": call.token_item_index,
        "created_at": call.created_at,
    }
    if call.legacy:
        # Writers before token_item_index left the arrays on the item that carried them.
        items = [dict(item) for item in call.output_items]
        carrier = items[call.token_item_index]
        for name in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
            carrier[name] = values[name]
        values["output_items"] = items
        values["token_item_index"] = None
    if call.write != "store":
        # These lines bypass the store (another writer, a crash); no validation.
        return TokenEntry.model_construct(**values)
    return TokenEntry(**values)


def _append_raw(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_rollout(store: TokenCaptureStore, conv: _Conversation, model: str, shape: str) -> None:
    rollout_id = conv.rollout_id
    path = store.paths(rollout_id).jsonl
    # Records land in completion order, as a model server writes them.
    for call in sorted(conv.calls, key=lambda c: c.created_at):
        if conv.announce:
            store.begin_call_now(rollout_id, call.call_id)
        if call.write == "store":
            store.append(_record(rollout_id, model, call))
        elif call.write == "direct":
            _append_raw(path, entry_line(_record(rollout_id, model, call)) + b"\n")
        elif call.write == "torn":
            line = entry_line(_record(rollout_id, model, call))
            _append_raw(path, line[: len(line) // 2])
        elif call.write == "torn_then_direct":
            # A proper prefix of a JSON object is never valid JSON; the writer came back
            # and wrote the record again on the next line.
            line = entry_line(_record(rollout_id, model, call))
            _append_raw(path, line[: len(line) // 3] + b"\n" + line + b"\n")
        elif call.write == "failed":
            store.mark_incomplete_now(rollout_id, call.call_id)
    if shape == "frozen":
        store.freeze_now(rollout_id)
    elif shape == "retired":
        snapshot = store.freeze_now(rollout_id)
        if not store.drop_now(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version):
            raise RuntimeError(f"rollout {rollout_id}: the store refused to drop its own fresh snapshot")


def _rollout_bytes(store: TokenCaptureStore, rollout_id: str) -> int:
    return sum(p.stat().st_size for p in store.paths(rollout_id) if p.exists())


def _check_new(store: TokenCaptureStore, rollout_id: str) -> None:
    paths = store.paths(rollout_id)
    if any(p.exists() for p in (paths.jsonl, paths.state, paths.intents, paths.incomplete)):
        raise FileExistsError(
            f"rollout {rollout_id} already has capture files in {store.directory}; "
            "generate into an empty directory or choose another id_prefix"
        )


def _check_range(name: str, bounds: tuple[int, int], low: int) -> None:
    if len(bounds) != 2 or not low <= bounds[0] <= bounds[1]:
        raise ValueError(f"CorpusSpec.{name} must be (low, high) with {low} <= low <= high, got {bounds!r}")


def _validate(spec: CorpusSpec) -> None:
    if spec.rollouts < 0:
        raise ValueError(f"CorpusSpec.rollouts must be >= 0, got {spec.rollouts}")
    # Four turns give every shape a first call, a middle call and a last call to act on.
    _check_range("turns", spec.turns, 4)
    _check_range("system_tokens", spec.system_tokens, 1)
    _check_range("generation_tokens", spec.generation_tokens, 1)
    _check_range("tool_tokens", spec.tool_tokens, 1)
    if spec.vocab_size < 16:
        raise ValueError(f"CorpusSpec.vocab_size must be at least 16, got {spec.vocab_size}")
    if not 0.0 <= spec.fault_share <= 1.0:
        raise ValueError(f"CorpusSpec.fault_share must be within [0, 1], got {spec.fault_share}")
    if not _ROLLOUT_ID_PREFIX.fullmatch(spec.id_prefix):
        raise ValueError(
            f"CorpusSpec.id_prefix {spec.id_prefix!r} may only use ASCII letters, digits, '.', '_' and '-'"
        )


def _assign_shapes(spec: CorpusSpec) -> list[str]:
    """The shape of each rollout: round(rollouts * fault_share) seeded picks get the
    shapes of `SHAPES` dealt in a seeded order, so every shape appears once enough
    rollouts are shaped; the rest are NORMAL."""
    rng = np.random.default_rng([spec.seed, 0x5A9E])
    shapes = [NORMAL] * spec.rollouts
    picked = rng.permutation(spec.rollouts)[: round(spec.rollouts * spec.fault_share)]
    order = [SHAPES[i] for i in rng.permutation(len(SHAPES))]
    for j, index in enumerate(sorted(picked.tolist())):
        shapes[index] = order[j % len(order)]
    return shapes


def generate_corpus(directory: str | os.PathLike, spec: CorpusSpec = CorpusSpec()) -> CorpusSummary:
    """Write `spec.rollouts` rollouts into `directory` (created if missing).

    Rollout i is named `{id_prefix}{i:04d}` and drawn from its own seeded generator, so
    its content does not depend on how many rollouts are generated."""
    _validate(spec)
    store = TokenCaptureStore(directory)
    width = max(4, len(str(max(spec.rollouts - 1, 0))))
    ids = tuple(f"{spec.id_prefix}{i:0{width}d}" for i in range(spec.rollouts))
    for rollout_id in ids:
        _check_new(store, rollout_id)
    template = _Template(spec.vocab_size)
    shapes: dict[str, str] = {}
    calls = 0
    total = 0
    for i, (rollout_id, shape) in enumerate(zip(ids, _assign_shapes(spec))):
        conv = _Conversation(np.random.default_rng([spec.seed, 1, i]), spec, rollout_id, template)
        _plan(conv, shape)
        _write_rollout(store, conv, spec.model, shape)
        shapes[rollout_id] = shape
        calls += len(conv.calls)
        total += _rollout_bytes(store, rollout_id)
    return CorpusSummary(str(store.directory), ids, shapes, calls, total)


def long_rollout(
    directory: str | os.PathLike,
    rollout_id: str = "long-0",
    calls: int = 1000,
    seed: int = 0,
    *,
    system_tokens: tuple[int, int] = (200, 400),
    generation_tokens: tuple[int, int] = (1, 6),
    tool_tokens: tuple[int, int] = (1, 4),
    vocab_size: int = 151_936,
    model: str = CorpusSpec.model,
) -> CorpusSummary:
    """Write one rollout of `calls` chained calls (default 1,000: about 18 MB).

    Every prompt repeats the whole history, so bytes grow with calls squared; the turns
    are small and carry no chat-template markers to keep the file a few tens of MB."""
    if calls < 1:
        raise ValueError(f"long_rollout needs at least 1 call, got {calls}")
    spec = CorpusSpec(
        rollouts=1,
        seed=seed,
        system_tokens=system_tokens,
        generation_tokens=generation_tokens,
        tool_tokens=tool_tokens,
        vocab_size=vocab_size,
        model=model,
    )
    _validate(spec)
    store = TokenCaptureStore(directory)
    _check_new(store, rollout_id)  # also refuses an invalid rollout id
    template = _Template(vocab_size, markers=False)
    conv = _Conversation(np.random.default_rng([seed, 2]), spec, rollout_id, template)
    conv.turns(conv.first_prompt(), calls)
    _write_rollout(store, conv, model, LONG)
    size = _rollout_bytes(store, rollout_id)
    return CorpusSummary(str(store.directory), (rollout_id,), {rollout_id: LONG}, calls, size)


def main(argv: Sequence[str] | None = None, prog: str = "python -m raycap.cli.synth") -> int:
    from raycap.cli.jobs import CommandParser, Console, add_console_flags

    parser = CommandParser(
        prog=prog, description="Write a synthetic token-capture corpus.",
    )
    parser.add_argument("out_dir", help="capture directory to write (created if missing)")
    parser.add_argument("--rollouts", type=int, default=CorpusSpec.rollouts, help="rollouts to write")
    parser.add_argument("--seed", type=int, default=CorpusSpec.seed, help="the same seed writes the same bytes")
    parser.add_argument(
        "--fault-share", type=float, default=CorpusSpec.fault_share,
        help="share of rollouts given a fault shape (retries, branches, damaged files, ...)",
    )
    parser.add_argument("--id-prefix", default=CorpusSpec.id_prefix, help="rollout ids are PREFIX0000, PREFIX0001, ...")
    parser.add_argument(
        "--long-calls", type=int, default=0, help="also write one long rollout of this many calls (0: none)"
    )
    add_console_flags(parser, "the same lines (synth has nothing more to say)")
    args = parser.parse_args(argv)
    out = Console(prog, quiet=args.quiet, json=args.json, command="synth")
    started = time.perf_counter()
    spec = CorpusSpec(
        rollouts=args.rollouts, seed=args.seed, fault_share=args.fault_share, id_prefix=args.id_prefix
    )
    long_id = f"{args.id_prefix}long-0"
    try:
        if args.long_calls:
            _validate(spec)
            _check_new(TokenCaptureStore(args.out_dir), long_id)  # before anything is written
        summary = generate_corpus(args.out_dir, spec)
        if args.long_calls:
            extra = long_rollout(args.out_dir, long_id, calls=args.long_calls, seed=args.seed)
            summary = CorpusSummary(
                summary.directory,
                summary.rollout_ids + extra.rollout_ids,
                {**summary.shapes, **extra.shapes},
                summary.calls + extra.calls,
                summary.bytes_written + extra.bytes_written,
            )
    except (ValueError, FileExistsError) as exc:
        return out.finish(out.fail(str(exc)))
    out.say(f"{summary.line()} in {time.perf_counter() - started:.1f} s")
    shaped = sum(1 for shape in summary.shapes.values() if shape in SHAPES)
    return out.finish(
        0, directory=summary.directory, rollouts=len(summary.rollout_ids), shaped=shaped, calls=summary.calls,
        bytes=summary.bytes_written,
    )


if __name__ == "__main__":
    sys.exit(main())
