"""One synthetic agent conversation, seeded: its model calls, in a chat template.

A rollout is a system prompt and a user task, then turns. Every turn is one model call
whose prompt is exactly the previous call's prompt + generation + the tool (or user)
output that followed, so the calls chain by token prefix. Generations end with the
end-of-turn marker and carry negative float32 log probs; output items mimic the
Responses API with the token arrays removed and `token_item_index` naming the item that
carried them. Timestamps increase with simulated latency. Token arrays are drawn with
numpy and converted with `.tolist()` once per call, because a per-token Python loop
would make a 230 MB corpus take minutes instead of seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

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
    """Draws the calls of one rollout (`spec`: a `raycap.cli.synth.CorpusSpec`); the clock
    only moves forward."""

    def __init__(self, rng: np.random.Generator, spec: Any, rollout_id: str, template: _Template):
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
