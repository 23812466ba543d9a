"""The shapes a synthetic rollout may take besides a normal conversation: `SHAPES`.

Shaped rollouts get them in a seeded order, every shape once before any shape repeats:
retries, branches, compaction, side calls, capture failures, damaged files, retired or
frozen rollouts, legacy records, MoE routing data, ambiguous parents. `_plan` lays a
shape's calls out on a conversation; shapes that damage a file are written by
`raycap.cli.synth`, directly, as an external writer or a crash would.
"""

from __future__ import annotations

import numpy as np

from raycap.cli.conversation import _Conversation

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


def _plan(conv: _Conversation, shape: str) -> None:
    """Draw the calls of one rollout of `shape` into `conv.calls`, each marked with how
    its record lands (see `raycap.cli.synth._write_rollout`)."""
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
