"""Builders: turn the model calls of one rollout into trajectories.

`per_request` makes one chain per call. `prefix_merging` chains calls by token prefix:
a call's parent is the call whose prompt+generation is the longest prefix of its
prompt. The result does not depend on capture order: calls are processed by (prompt
length, model_call_id).

Fail closed. A call whose parent is ambiguous (several calls produced exactly that
sequence) is quarantined, and so is every path through it, because training on the
wrong parent would attach log probs to tokens the policy never saw in that context.
Retries (same parent, identical prompt) keep the siblings that were continued; when
none was, the smallest id is kept and the group is reported as unresolved, which masks
the rollout.

The work is linear in captured tokens: parent candidates are found with position-weighted
prefix hashes of the token arrays and the chosen parent is verified exactly, so a hash
collision can cost time but never a wrong parent. Rollouts of thousands of calls are
walked iteratively.

This is NeMo Gym's `builder` module (`raycap.builders` is the same module under raycap's
earlier name). The public shapes are NeMo Gym's, name for name: `run_builder(entries, builder)`,
`per_request` and `prefix_merging` return `BuildOutput(chains, quarantined, notes)`
(`raycap.capture.buildoutput`); a chain is written as Responses output items by
`raycap.capture.projection`. Every one of those names is importable from here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Gym's builder module holds these names: they are importable from here as from Gym's.
from raycap.capture.buildoutput import (  # noqa: F401 - re-exported
    BuildNotes,
    BuildOutput,
    Chain,
    ChainLink,
    ReadEntries,
    call_arrays,
)
from raycap.capture.projection import (  # noqa: F401 - re-exported
    ProjectedCall,
    Projection,
    assert_items_contiguous,
    assert_prefix_contiguity,
    carrier_indices,
    checked_usage,
    main_chain,
    project_chain,
    project_chain_to_output_items,
    project_main_chain_response,
    projection_items,
    response_from_items,
)
from raycap.capture.records import CallArrays, TokenEntry, int_array  # noqa: F401 - CallArrays re-exported

BUILDERS = ("per_request", "prefix_merging")

# Gym's types belong to Gym's builder module: pickles and reprs name it, as they did
# before they moved, and an unpickler finds them here.
for _type in (BuildNotes, BuildOutput, Chain, ChainLink, ReadEntries, ProjectedCall, Projection):
    _type.__module__ = __name__
del _type


# --- prefix hashing -------------------------------------------------------------------

_WEIGHTS = np.empty(0, dtype=np.uint64)


def _weights(n: int) -> np.ndarray:
    """Fixed pseudo-random odd position weights; hash(seq[:L]) = sum(seq[i] * w[i]).

    Weight i depends on i alone (splitmix64 of it), so the weights a build has hashed
    with stay the same when the table grows. Hashes only pick candidates, which are
    then compared token by token. numpy.random is not used: importing it is 23 ms of
    every process's first build."""
    global _WEIGHTS
    if len(_WEIGHTS) < n:
        size = max(n, 2 * len(_WEIGHTS), 1 << 16)
        z = (np.arange(size, dtype=np.uint64) + np.uint64(0x5EED)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        _WEIGHTS = (z ^ (z >> np.uint64(31))) | np.uint64(1)
    return _WEIGHTS


def _prefix_hashes(tokens: np.ndarray, offset: int = 0) -> np.ndarray:
    """Running hashes of tokens placed at positions offset.. (wrapping uint64 arithmetic)."""
    w = _weights(offset + len(tokens))[offset : offset + len(tokens)]
    if tokens.dtype == object:
        return np.cumsum([int(t) * int(x) for t, x in zip(tokens, w)], dtype=object) % (1 << 64)
    return np.cumsum(tokens.view(np.uint64) * w, dtype=np.uint64)


def _seq_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if len(a) != len(b):
        return False
    if a.dtype == b.dtype and a.dtype.kind in "iu":
        # Equal integer arrays of one dtype have equal bytes: one comparison of memory,
        # a tenth of array_equal's cost on a short prompt. (Not for object arrays, whose
        # bytes are pointers.)
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


def _one_home(a: CallArrays, b: CallArrays) -> bool:
    """Whether the prompts of a and b are prefixes of one buffer, so that they agree on
    their common length without comparing a token (see CallArrays.home)."""
    return a.home is not None and a.home is b.home


class _PromptHashes:
    """Prefix hashes of the prompts of one build. Prompts with one home share their
    hashes: a prompt that extends an earlier one costs only its new tokens. The cache
    holds the homes, so no id is reused while it lives."""

    def __init__(self) -> None:
        self.by_home: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}

    def of(self, arrays: CallArrays) -> np.ndarray:
        prompt, home = arrays.prompt, arrays.home
        if home is None:
            return _prefix_hashes(prompt)
        hashes, _, filled = self.by_home.get(id(home)) or (np.empty(len(home), dtype=np.uint64), home, 0)
        if len(prompt) > filled:
            tail = _prefix_hashes(prompt[filled:], filled)
            if filled:
                tail += hashes[filled - 1]
            hashes[filled : len(prompt)] = tail
            self.by_home[id(home)] = (hashes, home, len(prompt))
        return hashes[: len(prompt)]


# --- per_request ----------------------------------------------------------------------


def per_request(entries: Sequence[TokenEntry], arrays: Sequence[CallArrays] | None = None) -> BuildOutput:
    """One chain per call, ordered by (prompt length, model_call_id)."""
    arrays = list(arrays) if arrays is not None else call_arrays(entries)
    order = sorted(range(len(entries)), key=lambda i: (len(arrays[i].prompt), entries[i].model_call_id))
    empty = arrays[0].prompt[:0] if arrays else np.empty(0, dtype=np.int64)
    chains = [
        Chain(f"req-{n}", [ChainLink(entries[i], empty, arrays=arrays[i])], arrays[i].prompt) for n, i in enumerate(order)
    ]
    return BuildOutput(chains, [], BuildNotes("per_request", chains=len(chains)))


# --- prefix_merging -------------------------------------------------------------------


@dataclass
class _Merge:
    """Intermediate state of prefix_merging, indexed by processing position."""

    entries: list[TokenEntry]
    arrays: list[CallArrays]
    parent: list[int]
    children: list[list[int]]
    quarantined: list[bool]
    roots: int
    prompt_hash: list[int]  # hash of each whole prompt (0 when compared directly), to group retry siblings


# Up to this many calls, every earlier call is a candidate parent, compared token by
# token: hashing the prompts costs more than the few comparisons (a two-call rollout's
# parents: 34 to 39 us through the hashes, 6 us compared directly).
DIRECT_MAX_CALLS = 4


def _infer_parents(entries: list[TokenEntry], arrays: list[CallArrays]) -> _Merge:
    """Each call's parent: among the calls before it (in processing order) whose prompt
    plus generation its prompt starts with, those of the longest such length; more than
    one quarantines the call. The candidates are compared token by token; past a few
    calls, hashes of the prompts' prefixes pick them (`_HashedCandidates`)."""
    n = len(entries)
    parent = [-1] * n
    children: list[list[int]] = [[] for _ in range(n)]
    quarantined = [False] * n
    roots = 0
    candidates = _DirectCandidates(arrays) if n <= DIRECT_MAX_CALLS else _HashedCandidates(arrays)
    for k in range(n):
        found = candidates.parents_of(k)
        if found:
            parent[k] = found[0]
            children[found[0]].append(k)
            if len(found) > 1:
                quarantined[k] = True
        else:
            roots += 1
    return _Merge(entries, arrays, parent, children, quarantined, roots, candidates.prompt_hash)


class _DirectCandidates:
    """Every call before k is a candidate. Its prompt_hash is 0 for every call: retry
    siblings are then grouped by prompt length alone, and still compared token by token."""

    def __init__(self, arrays: list[CallArrays]) -> None:
        self.arrays = arrays
        self.cumulative = [len(a.prompt) + len(a.generation) for a in arrays]
        self.prompt_hash = [0] * len(arrays)

    def parents_of(self, k: int) -> list[int]:
        """The verified candidates of the longest cumulative length, in processing order."""
        arrays, cumulative = self.arrays, self.cumulative
        plen = len(arrays[k].prompt)
        for length in sorted({cumulative[p] for p in range(k) if cumulative[p] <= plen}, reverse=True):
            found = [p for p in range(k) if cumulative[p] == length and _is_cumulative_prefix(arrays[p], arrays[k], length)]
            if found:
                return found
        return []


class _HashedCandidates:
    """The calls before k whose prompt plus generation hashes as k's prompt prefix of
    that length does: the same parents as `_DirectCandidates`, since the hashes only pick
    candidates that the same comparison then decides. Calls must be asked for in
    processing order; each is a candidate for the later ones once asked for."""

    def __init__(self, arrays: list[CallArrays]) -> None:
        self.arrays = arrays
        self.by_key: dict[tuple[int, int], list[int]] = {}
        self.lengths: list[int] = []  # distinct cumulative lengths of processed calls, sorted
        self.prompt_hash = [0] * len(arrays)
        self.prompt_hashes = _PromptHashes()

    def parents_of(self, k: int) -> list[int]:
        arrays, lengths = self.arrays, self.lengths
        prompt, gen = arrays[k].prompt, arrays[k].generation
        plen = len(prompt)
        hashes = self.prompt_hashes.of(arrays[k])
        self.prompt_hash[k] = int(hashes[-1]) if plen else 0
        found: list[int] = []
        # Longest candidate first; the first verified length wins.
        for j in range(bisect.bisect_right(lengths, plen) - 1, -1, -1):
            length = lengths[j]
            hits = self.by_key.get((length, int(hashes[length - 1])))
            if not hits:
                continue
            found = [p for p in hits if _is_cumulative_prefix(arrays[p], arrays[k], length)]
            if found:
                break
        cum_len = plen + len(gen)
        cum_hash = (self.prompt_hash[k] + int(_prefix_hashes(gen, plen)[-1])) % (1 << 64)
        self.by_key.setdefault((cum_len, cum_hash), []).append(k)
        pos = bisect.bisect_left(lengths, cum_len)
        if pos == len(lengths) or lengths[pos] != cum_len:
            lengths.insert(pos, cum_len)
        return found


def _is_cumulative_prefix(candidate: CallArrays, call: CallArrays, length: int) -> bool:
    """Whether call's prompt starts with candidate's prompt + generation (`length` ids)."""
    plen = len(candidate.prompt)
    prompt = call.prompt
    return (
        (_one_home(candidate, call) or _seq_equal(prompt[:plen], candidate.prompt))
        and _seq_equal(prompt[plen:length], candidate.generation)
    )


def _resolve_retries(m: _Merge) -> list[str]:
    """Quarantine retry siblings that were not continued; return unresolved call ids."""
    if len({len(a.prompt) for a in m.arrays}) == len(m.arrays):
        return []  # siblings have equal prompts, so prompts of distinct lengths have none
    # Calls are grouped by parent (the roots form one group); inside a parent group, calls
    # with identical prompts are retry siblings. Dicts keep insertion order, so parent
    # groups come in the processing order of their first member, which resolves a
    # parent's group before its children's: "continued" means a non-quarantined child
    # *now*. Sibling sets inside a group come in the order of their first member.
    by_parent: dict[int, dict[tuple[int, int], list[list[int]]]] = {}
    first_of_group: dict[int, int] = {}
    for k in range(len(m.entries)):
        first_of_group.setdefault(m.parent[k], k)
        prompt = m.arrays[k].prompt
        candidates = by_parent.setdefault(m.parent[k], {}).setdefault((len(prompt), m.prompt_hash[k]), [])
        for siblings in candidates:
            if _seq_equal(m.arrays[siblings[0]].prompt, prompt):
                siblings.append(k)
                break
        else:
            candidates.append([k])
    ordered = sorted(
        (siblings for group in by_parent.values() for same_hash in group.values() for siblings in same_hash),
        key=lambda siblings: (first_of_group[m.parent[siblings[0]]], siblings[0]),
    )
    unresolved: list[str] = []
    for group in ordered:
        if len(group) < 2:
            continue
        kept = [k for k in group if any(not m.quarantined[c] for c in m.children[k])]
        if not kept:
            kept = [min(group, key=lambda k: m.entries[k].model_call_id)]
            unresolved.extend(m.entries[k].model_call_id for k in group)
        for k in group:
            if k not in kept:
                m.quarantined[k] = True
    return unresolved


def prefix_merging(entries: Sequence[TokenEntry], arrays: Sequence[CallArrays] | None = None) -> BuildOutput:
    """Chain calls by token prefix (SPEC section 3)."""
    arrays = list(arrays) if arrays is not None else call_arrays(entries)
    entries = list(entries)
    empty_calls = [e.model_call_id for e, a in zip(entries, arrays) if len(a.generation) == 0]
    live = [i for i, a in enumerate(arrays) if len(a.generation)]
    live.sort(key=lambda i: (len(arrays[i].prompt), entries[i].model_call_id))
    m = _infer_parents([entries[i] for i in live], [arrays[i] for i in live])
    unresolved = _resolve_retries(m)

    n = len(live)
    blocked = [False] * n  # a quarantined call on the path from the root
    for k in range(n):
        blocked[k] = m.quarantined[k] or (m.parent[k] >= 0 and blocked[m.parent[k]])
    paths: list[list[int]] = []
    for k in range(n):
        if m.children[k] or blocked[k]:
            continue
        path = [k]
        while m.parent[path[-1]] >= 0:
            path.append(m.parent[path[-1]])
        path.reverse()
        paths.append(path)

    main = min(
        range(len(paths)),
        key=lambda c: (m.entries[paths[c][0]].created_at, m.entries[paths[c][0]].model_call_id, c),
        default=None,
    )
    chains: list[Chain] = []
    branch = 0
    for c, path in enumerate(paths):
        if c == main:
            chain_id = "main"
        else:
            chain_id, branch = f"branch-{branch}", branch + 1
        root = m.arrays[path[0]]
        links = [ChainLink(m.entries[path[0]], root.prompt[:0], arrays=root)]
        for parent, k in zip(path, path[1:]):
            start = len(m.arrays[parent].prompt) + len(m.arrays[parent].generation)
            links.append(ChainLink(m.entries[k], m.arrays[k].prompt[start:], arrays=m.arrays[k]))
        chains.append(Chain(chain_id, links, root.prompt))

    captured = sum(len(a.generation) for a in m.arrays)
    delivered = sum(len(m.arrays[k].generation) for k in paths[main]) if main is not None else 0
    notes = BuildNotes(
        builder="prefix_merging",
        roots=m.roots,
        chains=len(chains),
        generated_tokens_captured=captured,
        generated_tokens_delivered=delivered,
        delivered_fraction=round(delivered / captured, 4) if captured else 0.0,
        unresolved_retries=unresolved,
        empty_generation_calls=empty_calls,
    )
    quarantined = [m.entries[k].model_call_id for k in range(n) if m.quarantined[k]]
    return BuildOutput(chains, quarantined, notes)


def run_builder(
    entries: Sequence[TokenEntry], builder: str = "prefix_merging", *, arrays: Sequence[CallArrays] | None = None
) -> BuildOutput:
    """Run the builder called `builder`. `arrays` are the entries' arrays when the caller
    has them already (raycap's bulk path); an unknown name is a ValueError."""
    if builder == "per_request":
        return per_request(entries, arrays)
    if builder == "prefix_merging":
        return prefix_merging(entries, arrays)
    raise ValueError(f"unknown builder {builder!r}; known builders: {', '.join(BUILDERS)}")
