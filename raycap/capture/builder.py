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

Projection writes one chain as Responses output items: every call's items are copied
and the carrier item receives the running token sequence before the generation, the
generation and its log probs.

This is NeMo Gym's `builder` module (`raycap.builders` is the same module under raycap's
earlier name). The public shapes are NeMo Gym's, name for name: `run_builder(entries, builder)`,
`per_request` and `prefix_merging` return `BuildOutput(chains, quarantined, notes)` with
typed `BuildNotes`, and `Chain.root_prompt` and `ChainLink.interstitial` read as lists of
ints. Underneath they hold slices of the reader's int64 arrays; a list is made only when
someone reads the attribute, so the bulk row path, which projects through the arrays,
never makes one. `assert_prefix_contiguity` takes a response and walks its output;
`assert_items_contiguous` is the same check over a list of items.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from raycap.capture.records import CallArrays, TokenEntry, int_array

BUILDERS = ("per_request", "prefix_merging")


class _Ids:
    """A dataclass field of token ids that reads as `list[int]` and may be stored as an
    int64 array: the builders hand out slices of the reader's arrays, and only a caller
    who reads the attribute pays for a list. The list is made once, on first read.

    `array_of(obj, name)` gives the array form (converted once, the other way, when the
    field was given a list), so projection never goes through lists."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = f"_{name}_ids"

    def __get__(self, obj: Any, owner: type | None = None) -> list[int]:
        if obj is None:
            raise AttributeError(self.name)  # a required field: no default
        value = obj.__dict__[self.slot]
        if isinstance(value, np.ndarray):
            value = value.tolist()
            obj.__dict__[self.slot] = value
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        if isinstance(value, np.ndarray):
            obj.__dict__[self.slot + "_array"] = value
        else:
            value = list(value)
            obj.__dict__.pop(self.slot + "_array", None)
        obj.__dict__[self.slot] = value


def _array_of(obj: Any, name: str) -> np.ndarray:
    """The ids of an `_Ids` field as an array, without making a list."""
    slot = f"_{name}_ids"
    array = obj.__dict__.get(slot + "_array")
    if array is None:
        array = int_array(obj.__dict__[slot])
        obj.__dict__[slot + "_array"] = array
    return array


@dataclass(frozen=True)
class ChainLink:
    """One call of a chain. `interstitial` is the prompt ids added since the parent's
    prompt and generation (tool output, user turns); empty for the root."""

    entry: TokenEntry
    interstitial: list[int] = _Ids()  # type: ignore[assignment]
    # The call's arrays as the builder already converted them, so projection does not
    # convert the token lists again; None for links made by hand.
    arrays: CallArrays | None = field(default=None, repr=False, compare=False, kw_only=True)

    @property
    def interstitial_array(self) -> np.ndarray:
        return _array_of(self, "interstitial")


@dataclass(frozen=True)
class Chain:
    """One trajectory: `root_prompt`, then each link's interstitial ids and generation."""

    chain_id: str
    links: list[ChainLink]
    root_prompt: list[int] = _Ids()  # type: ignore[assignment]

    @property
    def root_prompt_array(self) -> np.ndarray:
        return _array_of(self, "root_prompt")

    def validate(self) -> None:
        """Refuse a chain whose links do not pair every generated id with one log prob:
        ValueError naming the first such call. Records are checked when read, so only a
        link made by hand (or a record changed since) can fail here."""
        for link in self.links:
            entry = link.entry
            n_logprobs, n_tokens = len(entry.generation_log_probs), len(entry.generation_token_ids)
            if n_logprobs != n_tokens:
                raise ValueError(f"log-prob/token length mismatch on {entry.model_call_id}: {n_logprobs} vs {n_tokens}")


@dataclass
class BuildNotes:
    """What a builder reports besides its chains (SPEC section 3).

    `per_request` records only `builder` and `chains`; its other fields keep their
    defaults and mean nothing (`merged` is False), so a metric never reads them as a
    measured zero. Typed, so a renamed field fails loudly instead of reading as zero."""

    builder: str
    roots: int = 0
    chains: int = 0
    generated_tokens_captured: int = 0
    generated_tokens_delivered: int = 0
    delivered_fraction: float = 0.0
    unresolved_retries: list[str] = field(default_factory=list)
    empty_generation_calls: list[str] = field(default_factory=list)

    @property
    def merged(self) -> bool:
        """Whether the builder chained calls, so roots and token counts were measured."""
        return self.builder != "per_request"


@dataclass(frozen=True)
class BuildOutput:
    chains: list[Chain]
    quarantined: list[str]
    notes: BuildNotes


class ReadEntries(list):
    """Entries as a reader parsed them, remembering the arrays it converted (one per
    entry), so a builder reached through a public seam (`run_builder(entries, builder)`)
    does not convert every token list again. The arrays are used only while the list
    still holds exactly the same entry objects: a caller that filters, reorders or
    replaces entries gets a fresh conversion. Entries are read-only to builders."""

    def __init__(self, entries: Sequence[TokenEntry], arrays: Sequence[CallArrays]) -> None:
        super().__init__(entries)
        self._entries = tuple(entries)
        self._arrays = list(arrays)

    def converted(self) -> list[CallArrays] | None:
        if len(self) != len(self._entries) or any(a is not b for a, b in zip(self, self._entries)):
            return None
        return list(self._arrays)


def call_arrays(entries: Sequence[TokenEntry]) -> list[CallArrays]:
    if isinstance(entries, ReadEntries) and (arrays := entries.converted()) is not None:
        return arrays
    return [CallArrays.of(entry) for entry in entries]


# --- prefix hashing -------------------------------------------------------------------

_WEIGHTS = np.empty(0, dtype=np.uint64)


def _weights(n: int) -> np.ndarray:
    """Fixed pseudo-random odd position weights; hash(seq[:L]) = sum(seq[i] * w[i])."""
    global _WEIGHTS
    if len(_WEIGHTS) < n:
        size = max(n, 2 * len(_WEIGHTS), 1 << 16)
        rng = np.random.default_rng(0x5EED)
        _WEIGHTS = rng.integers(0, 2**63, size=size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return _WEIGHTS


def _prefix_hashes(tokens: np.ndarray, offset: int = 0) -> np.ndarray:
    """Running hashes of tokens placed at positions offset.. (wrapping uint64 arithmetic)."""
    w = _weights(offset + len(tokens))[offset : offset + len(tokens)]
    if tokens.dtype == object:
        return np.cumsum([int(t) * int(x) for t, x in zip(tokens, w)], dtype=object) % (1 << 64)
    return np.cumsum(tokens.view(np.uint64) * w, dtype=np.uint64)


def _seq_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and bool(np.array_equal(a, b))


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
    prompt_hash: list[int]  # hash of each whole prompt, to group retry siblings


def _infer_parents(entries: list[TokenEntry], arrays: list[CallArrays]) -> _Merge:
    n = len(entries)
    parent = [-1] * n
    children: list[list[int]] = [[] for _ in range(n)]
    quarantined = [False] * n
    by_key: dict[tuple[int, int], list[int]] = {}
    lengths: list[int] = []  # distinct cumulative lengths of processed calls, sorted
    roots = 0
    prompt_hash = [0] * n
    prompt_hashes = _PromptHashes()
    for k in range(n):
        prompt, gen = arrays[k].prompt, arrays[k].generation
        plen = len(prompt)
        hashes = prompt_hashes.of(arrays[k])
        prompt_hash[k] = int(hashes[-1]) if plen else 0
        found: list[int] = []
        # Longest candidate first; the first verified length wins.
        for j in range(bisect.bisect_right(lengths, plen) - 1, -1, -1):
            length = lengths[j]
            hits = by_key.get((length, int(hashes[length - 1])))
            if not hits:
                continue
            found = [p for p in hits if _is_cumulative_prefix(arrays[p], arrays[k], length)]
            if found:
                break
        if found:
            parent[k] = found[0]
            children[found[0]].append(k)
            if len(found) > 1:
                quarantined[k] = True
        else:
            roots += 1
        cum_len = plen + len(gen)
        cum_hash = (prompt_hash[k] + int(_prefix_hashes(gen, plen)[-1])) % (1 << 64)
        by_key.setdefault((cum_len, cum_hash), []).append(k)
        pos = bisect.bisect_left(lengths, cum_len)
        if pos == len(lengths) or lengths[pos] != cum_len:
            lengths.insert(pos, cum_len)
    return _Merge(entries, arrays, parent, children, quarantined, roots, prompt_hash)


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


# --- projection -----------------------------------------------------------------------


def _carries_tokens(item: Any) -> bool:
    return isinstance(item, dict) and item.get("generation_token_ids") is not None


def carrier_indices(entry: TokenEntry) -> tuple[int, ...]:
    """Which output items of a call receive its token arrays; () means a synthesized item."""
    items = entry.output_items
    index = entry.token_item_index
    if index is not None and 0 <= index < len(items):
        return (index,)
    inline = tuple(i for i, item in enumerate(items) if _carries_tokens(item))
    if inline:
        return inline  # older records kept the arrays on the item itself
    return (len(items) - 1,) if items else ()


@dataclass(frozen=True)
class ProjectedCall:
    """One call of a projected chain: its generation spans token_ids[gen_start:gen_end]."""

    model_call_id: str
    output_items: list[dict]
    routed_experts: Any
    gen_start: int
    gen_end: int
    carriers: tuple[int, ...]


@dataclass(frozen=True)
class Projection:
    """A chain as training-ready arrays plus what is needed to write its Responses items.

    token_ids is the full sequence of the chain; every carrier's prompt is a prefix of it,
    so the quadratic per-call prompt copies exist only when dicts are asked for."""

    token_ids: np.ndarray
    log_probs: np.ndarray  # captured values on generated positions, 0.0 elsewhere
    loss_mask: np.ndarray  # 1 on generated positions
    calls: list[ProjectedCall]


def project_chain(chain: Chain) -> Projection:
    root_prompt = chain.root_prompt_array
    parts: list[np.ndarray] = [root_prompt]
    spans: list[tuple[int, int]] = []
    size = len(root_prompt)
    gens = []
    for pos, link in enumerate(chain.links):
        if pos:
            interstitial = link.interstitial_array
            parts.append(interstitial)
            size += len(interstitial)
        arrays = link.arrays if link.arrays is not None else CallArrays.of(link.entry)
        gen, lp = arrays.generation, arrays.log_probs
        if len(lp) != len(gen):
            raise ValueError(
                f"call {link.entry.model_call_id} has {len(lp)} log probs for {len(gen)} generated ids"
            )
        parts.append(gen)
        gens.append(lp)
        spans.append((size, size + len(gen)))
        size += len(gen)
    token_ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    log_probs = np.zeros(len(token_ids), dtype=np.float64)
    loss_mask = np.zeros(len(token_ids), dtype=np.int8)
    calls = []
    for link, (start, end), lp in zip(chain.links, spans, gens):
        log_probs[start:end] = lp
        loss_mask[start:end] = 1
        entry = link.entry
        calls.append(
            ProjectedCall(entry.model_call_id, entry.output_items, entry.routed_experts, start, end, carrier_indices(entry))
        )
    return Projection(token_ids, log_probs, loss_mask, calls)


def projection_items(projection: Projection) -> list[dict]:
    """The Responses output items of a projected chain (copies; the carriers filled in)."""
    token_ids, log_probs = projection.token_ids, projection.log_probs
    out: list[dict] = []
    for call in projection.calls:
        fields = {
            "prompt_token_ids": token_ids[: call.gen_start].tolist(),
            "generation_token_ids": token_ids[call.gen_start : call.gen_end].tolist(),
            "generation_log_probs": log_probs[call.gen_start : call.gen_end].tolist(),
        }
        if call.routed_experts is not None:
            fields["routed_experts"] = call.routed_experts
        if not call.carriers:
            out.append({"type": "message", **fields})
            continue
        items = [dict(item) for item in call.output_items]
        first, *others = call.carriers
        items[first].update(fields)
        for index in others:  # older records with several inline carriers: each its own lists
            items[index].update({key: list(value) if isinstance(value, list) else value for key, value in fields.items()})
        out.extend(items)
    return out


def project_chain_to_output_items(chain: Chain) -> list[dict]:
    return projection_items(project_chain(chain))


def _token_bearing(items: list[dict]) -> list[dict]:
    return [item for item in items if _carries_tokens(item)]


def response_from_items(rollout_id: str, items: list[dict], model: str) -> dict:
    """Wrap projected items as one Responses payload (usage over token-bearing items)."""
    bearing = _token_bearing(items)
    if not any(item["generation_token_ids"] for item in bearing):
        raise ValueError("capture produced no trainable generated tokens")
    usage = {
        "input_tokens": len(bearing[0]["prompt_token_ids"]),
        "output_tokens": sum(len(item["generation_token_ids"]) for item in bearing),
    }
    return {"id": f"proj-{rollout_id}", "model": model, "object": "response", "output": items, "usage": usage}


def main_chain(build: BuildOutput) -> Chain:
    if not build.chains:
        raise ValueError("capture produced no safe trainable chain")
    if not build.notes.merged and len(build.chains) > 1:
        raise ValueError(
            f"per_request produced {len(build.chains)} trajectories; single-response delivery needs exactly one"
        )
    for chain in build.chains:
        if chain.chain_id == "main":
            return chain
    return build.chains[0]


def project_main_chain_response(rollout_id: str, out: BuildOutput, model: str = "") -> dict:
    """The main chain of a builder's output `out` as one Responses payload (SPEC section 4)."""
    return response_from_items(rollout_id, project_chain_to_output_items(main_chain(out)), model)


def assert_prefix_contiguity(response: dict) -> None:
    """Walk `response["output"]`: every item carrying generation_token_ids must have a
    prompt_token_ids that extends every prompt and generation id seen before it (a
    missing or null prompt counts as empty); otherwise AssertionError."""
    assert_items_contiguous(response["output"])


def assert_items_contiguous(items: list[dict]) -> None:
    """`assert_prefix_contiguity` over a list of output items."""
    seen: list = []
    for item in _token_bearing(items):
        prompt = item.get("prompt_token_ids") or []
        if len(prompt) < len(seen) or list(prompt[: len(seen)]) != list(seen):
            raise AssertionError(
                f"projection is not prefix-contiguous: a {item.get('type', 'item')} item's prompt of "
                f"{len(prompt)} ids does not extend the {len(seen)} ids before it"
            )
        seen = list(prompt) + list(item["generation_token_ids"])


def _has_inline_strays(projection: Projection) -> bool:
    """Does any non-carrier item still carry token arrays inline (older records)?"""
    for call in projection.calls:
        for index, item in enumerate(call.output_items):
            if index not in call.carriers and _carries_tokens(item):
                return True
    return False


def checked_usage(projection: Projection) -> dict:
    """Usage of the projected response, after the no-tokens and contiguity checks.

    Carriers' prompts are prefixes of one token array, so contiguity reduces to span
    arithmetic. An item that still carries its own inline arrays breaks that assumption;
    such chains are checked on the materialised items, exactly as written out.
    """
    if _has_inline_strays(projection):
        items = projection_items(projection)
        usage = response_from_items("", items, "")["usage"]
        assert_items_contiguous(items)
        return usage
    spans = [(call.gen_start, call.gen_end) for call in projection.calls for _ in (call.carriers or (None,))]
    if not any(end > start for start, end in spans):
        raise ValueError("capture produced no trainable generated tokens")
    seen = 0
    for start, end in spans:
        if start < seen:
            raise AssertionError(
                f"projection is not prefix-contiguous: a prompt of {start} ids does not extend the {seen} ids before it"
            )
        seen = end
    return {"input_tokens": spans[0][0], "output_tokens": sum(end - start for start, end in spans)}
