"""Synthetic capture corpora: realistic agentic-RL rollouts written as capture directories.

A corpus is a directory in the on-disk capture format, written through
`TokenCaptureStore` exactly as a model server would write it, so everything downstream
(freeze, builders, the cluster pipeline, benchmarks) reads it like a real capture.

A normal rollout is one agent conversation in a chat template: a system prompt and a
user task, then 4-40 turns. Every turn is one model call whose prompt is exactly the
previous call's prompt + generation + the tool (or user) output that followed, so the
calls chain by token prefix. Generations end with the end-of-turn marker and carry
negative float32 log probs; output items mimic the Responses API with the token arrays
removed and `token_item_index` naming the item that carried them. Timestamps increase
with simulated latency.

A configurable share of rollouts gets one *shape* from `SHAPES`: retries, branches,
compaction, side calls, capture failures, damaged files, retired or frozen rollouts,
legacy records, MoE routing data, ambiguous parents. Shapes that damage a file write to
it directly, as an external writer or a crash would, bypassing the store's index; the
store recovers or reports them when the rollout is frozen.

Everything is a function of the seed: the same spec writes the same bytes (apart from
the random snapshot ids the store gives frozen rollouts). Token arrays are drawn with
numpy and converted with `.tolist()` once per call, because a per-token Python loop would
make a 230 MB corpus take minutes instead of seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from raycap.capture.records import TokenEntry, entry_line
from raycap.capture.store import TokenCaptureStore

# Rollout shapes. Shaped rollouts get them in a seeded order, every shape once before any
# shape repeats.
SHAPES = (
    "retry_resolved",  # a call retried; the conversation continued from the retry
    "retry_unresolved",  # the final call retried; neither attempt was continued
    "retry_first_call",  # the first call retried; the conversation continued from the retry
    "subagent_branch",  # a sub-agent conversation extends the main history differently
    "compaction",  # the history was summarised into a fresh short prompt, then continued
    "side_call",  # a one-off call on a prefix of the history (title, judge, ...)
    "empty_generation",  # a call that generated nothing, then retried
    "lost_call",  # a call announced with begin_call whose record never landed
    "mark_incomplete",  # a call whose capture failed and was reported as such
    "torn_final_line",  # the writer died mid-line: half a JSON line, no newline
    "corrupt_middle_line",  # a cut-off line between complete ones, from a writer without index
    "newer_schema",  # a record of schema_version 2 from a newer writer
    "logprob_mismatch",  # a record with one log prob fewer than generated ids
    "retired",  # frozen, consumed and dropped: only the tombstone state remains
    "frozen",  # already frozen by an earlier consumer
    "legacy_inline",  # old records: token arrays inline on the carrier item, no index
    "routed_experts",  # MoE routing data on every call
    "identical_parents",  # a call duplicated token for token, so its child is ambiguous
)
NORMAL = "normal"
LONG = "long"

_ROLLOUT_ID_PREFIX = re.compile(r"[A-Za-z0-9._-]*")
# Fixed so that a corpus does not depend on when it was generated.
_EPOCH = 1_750_000_000.0

_WORDS = np.array(
    (
        "the a of to and in is that for it with as on be this by file test value function "
        "result error list return call check should will we need first then next output "
        "input data path line number config run python module import class method string "
        "search query found missing update fix change add remove look let me now so if not "
        "case step plan tool answer because which when where all each more using into from "
        "directory read write open parse build index token model rollout prefix chain "
        "retry branch score reward policy sample batch step loss mask sequence length"
    ).split()
)
_TOOLS = ("search", "read_file", "run_python", "list_dir", "write_file", "browse")
_LENGTH_SKEW = 1.5
_MOE_LAYERS = 4
_MOE_TOP_K = 2
_MOE_EXPERTS = 64


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


# --------------------------------------------------------------------------- generation


@dataclass
class _ModelCall:
    """One model call as it happened; `write` says how (or whether) its record lands."""

    call_id: str
    prompt: np.ndarray
    generation: np.ndarray
    log_probs: np.ndarray
    created_at: float
    output_items: list[dict]
    token_item_index: int | None
    routed_experts: Any = None
    # "store"; "direct", "torn" or "torn_then_direct" (written to the file, bypassing the
    # store); "lost" (no record at all) or "failed" (no record, reported with
    # mark_incomplete).
    write: str = "store"
    schema_version: int = 1
    legacy: bool = False  # token arrays inline on the carrier item, no token_item_index


@dataclass(frozen=True)
class _Template:
    """Chat-template ids. Content ids stay below the two special ids (message start and
    end) at the top of the vocabulary; fixed ordinary ids stand for the role names and
    the newline. Without markers, turns are bare content ids."""

    vocab_size: int
    markers: bool = True

    @property
    def content_size(self) -> int:
        return self.vocab_size - 2

    @property
    def im_start(self) -> int:
        return self.vocab_size - 2

    @property
    def im_end(self) -> int:
        return self.vocab_size - 1

    def role(self, name: str) -> int:
        return {"system": 8948, "user": 872, "assistant": 77091, "tool": 14172}[name] % self.content_size

    @property
    def newline(self) -> int:
        return 198 % self.content_size


class _Conversation:
    """Draws the calls of one rollout; the clock only moves forward."""

    def __init__(self, rng: np.random.Generator, spec: CorpusSpec, rollout_id: str, template: _Template):
        self.rng = rng
        self.spec = spec
        self.rollout_id = rollout_id
        self.template = template
        self.clock = _EPOCH + float(rng.uniform(0.0, 86_400.0))
        self.calls: list[_ModelCall] = []
        self.routed_experts = False
        self.announce = False  # announce every call with begin_call before dispatch

    # ids ----------------------------------------------------------------------------

    def count(self, bounds: tuple[int, int], *, skewed: bool = False) -> int:
        """A count within inclusive bounds. Skewed counts favour the low end with a long
        tail, as generation and tool-output lengths do in agent traces."""
        low, high = bounds
        u = float(self.rng.random())
        return min(high, low + int((high - low + 1) * (u**_LENGTH_SKEW if skewed else u)))

    def content(self, n: int) -> np.ndarray:
        # Frequent tokens have small ids in BPE vocabularies; a power law over the id
        # range gives realistic id magnitudes (and so realistic JSON sizes).
        return (self.template.content_size * self.rng.random(n) ** 4).astype(np.int64)

    def message(self, role: str, n: int) -> np.ndarray:
        """One complete chat message of n content ids, ending with a newline."""
        t = self.template
        if not t.markers:
            return self.content(n)
        return np.concatenate(
            ([t.im_start, t.role(role), t.newline], self.content(n), [t.im_end, t.newline])
        ).astype(np.int64)

    def assistant_header(self) -> np.ndarray:
        t = self.template
        if not t.markers:
            return np.empty(0, dtype=np.int64)
        return np.array([t.im_start, t.role("assistant"), t.newline], dtype=np.int64)

    def first_prompt(self) -> np.ndarray:
        return np.concatenate(
            (
                self.message("system", self.count(self.spec.system_tokens)),
                self.message("user", self.count(self.spec.tool_tokens, skewed=True)),
                self.assistant_header(),
            )
        )

    def turn_input(self, role: str, n: int) -> np.ndarray:
        """What follows a generation before the next call: one message of n content ids
        and the next assistant header. The leading newline closes the generation's
        end-of-turn marker, as chat templates render it."""
        if not self.template.markers:
            return self.content(n)
        head = np.array([self.template.newline], dtype=np.int64)
        return np.concatenate((head, self.message(role, n), self.assistant_header()))

    def observation(self) -> np.ndarray:
        """A tool result or, sometimes, a user turn."""
        role = "user" if self.rng.random() < 0.1 else "tool"
        return self.turn_input(role, self.count(self.spec.tool_tokens, skewed=True))

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{self.rng.bytes(12).hex()}"

    # calls --------------------------------------------------------------------------

    def call(self, prompt: np.ndarray, *, final: bool = False, empty: bool = False) -> _ModelCall:
        """Sample one call on `prompt` and advance the clock by its latency."""
        n = 0 if empty else self.count(self.spec.generation_tokens, skewed=True)
        generation = self.content(n)
        # Most sampled tokens are near-certain, a few are surprising: a gamma with a small
        # shape gives that heavy tail. vLLM reports float32 log probs.
        log_probs = -np.clip(self.rng.gamma(0.35, 1.2, n), 1e-6, 30.0).astype(np.float32)
        if n and self.template.markers:
            generation[-1] = self.template.im_end
            log_probs[-1] = -np.float32(self.rng.uniform(1e-5, 1e-3))
        self.clock += 0.2 + n * float(self.rng.uniform(0.01, 0.03))
        items, carrier = self._output_items(n, final=final, empty=empty)
        routed = None
        if self.routed_experts and n:
            routed = self.rng.integers(0, _MOE_EXPERTS, (n, _MOE_LAYERS, _MOE_TOP_K)).tolist()
        record = _ModelCall(
            call_id=self.new_id("resp"),
            prompt=prompt,
            generation=generation,
            log_probs=log_probs,
            created_at=round(self.clock, 6),
            output_items=items,
            token_item_index=carrier,
            routed_experts=routed,
        )
        self.calls.append(record)
        return record

    def wait(self) -> None:
        """Time spent in tools between calls."""
        self.clock += float(self.rng.exponential(1.5)) + 0.01

    def turns(self, prompt: np.ndarray, n: int, *, final: bool = True) -> np.ndarray:
        """n chained calls starting at `prompt`; returns the history after the last
        generation (without the observation that would follow it). The last call
        answers when `final`, otherwise it asks for a tool like the others."""
        for k in range(n):
            last = k == n - 1
            history = np.concatenate((prompt, self.call(prompt, final=final and last).generation))
            if not last:
                self.wait()
                prompt = np.concatenate((history, self.observation()))
        return history

    def duplicate(self, original: _ModelCall) -> _ModelCall:
        """The same sampled tokens and text under new response ids, recorded a moment later."""
        self.clock += float(self.rng.uniform(0.05, 0.5))
        items = [dict(item) for item in original.output_items]
        for item in items:
            item["id"] = self.new_id(item["id"].partition("_")[0])
        record = replace(
            original, call_id=self.new_id("resp"), created_at=round(self.clock, 6), output_items=items
        )
        self.calls.append(record)
        return record

    # output items -------------------------------------------------------------------

    def _text(self, n_words: int) -> str:
        return " ".join(_WORDS[self.rng.integers(0, len(_WORDS), max(n_words, 1))].tolist())

    def _output_items(self, n: int, *, final: bool, empty: bool) -> tuple[list[dict], int]:
        if empty:
            return [self._message("")], 0
        items: list[dict] = []
        words = max(1, int(n * 0.7))
        if self.rng.random() < 0.8:
            share = float(self.rng.uniform(0.3, 0.8))
            items.append(
                {
                    "type": "reasoning",
                    "id": self.new_id("rs"),
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": self._text(int(words * share))}],
                    "encrypted_content": None,
                    "status": "completed",
                }
            )
            words = max(1, int(words * (1 - share)))
        if final:
            items.append(self._message(self._text(words)))
        else:
            for _ in range(2 if self.rng.random() < 0.15 else 1):
                items.append(self._function_call(words))
        # The item that was sampled last carries the token arrays in the served response.
        return items, len(items) - 1

    def _message(self, text: str) -> dict:
        return {
            "type": "message",
            "id": self.new_id("msg"),
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    def _function_call(self, words: int) -> dict:
        name = _TOOLS[int(self.rng.integers(0, len(_TOOLS)))]
        if name in ("read_file", "list_dir", "write_file"):
            arguments = {"path": "/".join(self._text(3).split())}
        elif name == "run_python":
            arguments = {"code": self._text(min(words, 60))}
        else:
            arguments = {"query": self._text(min(words, 12))}
        return {
            "type": "function_call",
            "id": self.new_id("fc"),
            "call_id": self.new_id("call"),
            "name": name,
            "arguments": json.dumps(arguments),
            "status": "completed",
        }


# ------------------------------------------------------------------------------ shapes


def _plan(conv: _Conversation, shape: str) -> None:
    """Draw the calls of one rollout of `shape` into `conv.calls`, each marked with how
    its record lands (see `_write_rollout`)."""
    if shape not in SHAPES and shape != NORMAL:
        raise ValueError(f"unknown rollout shape {shape!r}; known: {NORMAL}, {', '.join(SHAPES)}")
    rng = conv.rng
    n = conv.count(conv.spec.turns)
    system = conv.first_prompt()

    def middle(low: int, high: int) -> int:
        return int(rng.integers(low, high + 1))

    if shape == "retry_resolved":
        k = middle(1, n - 2)
        history = conv.turns(system, k, final=False)
        conv.wait()
        prompt = np.concatenate((history, conv.observation()))
        conv.call(prompt)  # abandoned: the client timed out and retried
        conv.turns(prompt, n - k)
    elif shape == "retry_unresolved":
        history = conv.turns(system, n - 1, final=False)
        conv.wait()
        prompt = np.concatenate((history, conv.observation()))
        conv.call(prompt, final=True)
        conv.call(prompt, final=True)
    elif shape == "retry_first_call":
        conv.call(system)
        conv.turns(system, n)
    elif shape == "subagent_branch":
        k = middle(1, n - 2)
        history = conv.turns(system, k + 1, final=False)
        # The sub-agent sees the main history, then its own task instead of a tool result.
        task = conv.turn_input("user", conv.count(conv.spec.tool_tokens, skewed=True))
        conv.wait()
        conv.turns(np.concatenate((history, task)), middle(2, 4))
        conv.wait()
        conv.turns(np.concatenate((history, conv.observation())), n - k - 1)
    elif shape == "compaction":
        k = middle(2, n - 2)
        conv.turns(system, k, final=False)
        conv.wait()
        fresh = np.concatenate(
            (
                conv.message("system", conv.count(conv.spec.system_tokens)),
                conv.message("user", conv.count((100, 400))),  # the summary of the history
                conv.assistant_header(),
            )
        )
        conv.turns(fresh, n - k)
    elif shape == "side_call":
        k = middle(1, n - 1)
        history = conv.turns(system, k, final=False)
        conv.wait()
        cut = middle(1, len(history) - 1)
        request = np.concatenate((conv.message("user", conv.count((20, 120))), conv.assistant_header()))
        conv.call(np.concatenate((history[:cut], request)), final=True)
        conv.wait()
        conv.turns(np.concatenate((history, conv.observation())), n - k)
    elif shape == "empty_generation":
        k = middle(1, n - 1)
        history = conv.turns(system, k, final=False)
        conv.wait()
        prompt = np.concatenate((history, conv.observation()))
        conv.call(prompt, empty=True)
        conv.turns(prompt, n - k)
    elif shape == "identical_parents":
        k = middle(0, n - 2)
        if k:
            history = conv.turns(system, k, final=False)
            conv.wait()
            prompt = np.concatenate((history, conv.observation()))
        else:
            prompt = system
        original = conv.call(prompt)
        conv.duplicate(original)
        conv.wait()
        conv.turns(np.concatenate((prompt, original.generation, conv.observation())), n - k - 1)
    else:
        conv.routed_experts = shape == "routed_experts"
        conv.turns(system, n)
        calls = conv.calls
        if shape == "lost_call":
            conv.announce = True
            calls[middle(1, n - 1)].write = "lost"
        elif shape == "mark_incomplete":
            calls[middle(1, n - 1)].write = "failed"
        elif shape == "torn_final_line":
            calls[-1].write = "torn"
        elif shape == "corrupt_middle_line":
            # A writer that keeps no index died mid-line and appends went on after it, so
            # the cut-off line sits between complete ones. (Rewriting the file instead
            # would shift the bytes under the store's index, which is a different fault.)
            m = middle(1, n - 2)
            calls[m].write = "torn_then_direct"
            for record in calls[m + 1 :]:
                record.write = "direct"
        elif shape == "newer_schema":
            calls[-1].write = "direct"
            calls[-1].schema_version = 2
        elif shape == "logprob_mismatch":
            calls[-1].write = "direct"
            calls[-1].log_probs = calls[-1].log_probs[:-1]
        elif shape == "legacy_inline":
            for record in calls:
                record.legacy = True
        # "retired" and "frozen" act on the written rollout; "routed_experts" is set above.


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raycap.cli.synth", description="Write a synthetic token-capture corpus."
    )
    parser.add_argument("out_dir", help="capture directory to write (created if missing)")
    parser.add_argument("--rollouts", type=int, default=CorpusSpec.rollouts)
    parser.add_argument("--seed", type=int, default=CorpusSpec.seed)
    parser.add_argument("--fault-share", type=float, default=CorpusSpec.fault_share)
    parser.add_argument("--id-prefix", default=CorpusSpec.id_prefix)
    parser.add_argument(
        "--long-calls", type=int, default=0, help="also write one long rollout of this many calls"
    )
    args = parser.parse_args(argv)
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
        print(f"raycap.cli.synth: {exc}", file=sys.stderr)
        return 2
    print(f"{summary.line()} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
