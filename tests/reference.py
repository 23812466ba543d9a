"""A slow, plainly written reference of the builders, the projection and the consumer.

Each rule of the specification's builder, projection and consumer sections is written
here as directly as the text states it, with plain lists and loops, so that a reader can
check every line against the spec. The fast implementation is tested against this module
and measured against it; it is never on the production path.

Two concessions to size keep a 1,000-call rollout within seconds: the parent search only
tries prefix lengths that some processed call's cumulative sequence actually has (a
longer or shorter prefix cannot equal any of them), and the walk from a leaf to its root
is a loop, because a recursion would overflow on long conversations.

`parent_search="trie"` selects the textbook alternative instead: a token trie of every
processed call's cumulative sequence, walked token by token along each prompt. It gives
the same parents and is the straightforward baseline the benchmark measures against.

The API mirrors the fast one so that results compare directly: chains in leaf order,
quarantined call ids in processing order, the same notes, the same build dicts and the
same error texts.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from raycap.capture.records import TokenEntry, iter_lines, loads_line

logger = logging.getLogger(__name__)

KNOWN_BUILDERS = ("per_request", "prefix_merging")

PER_REQUEST_UNSUPPORTED = (
    "per_request returns multiple trajectories and is not supported by single-response delivery"
)

# The exception kinds a build turns into a masked result; anything else is a bug and
# propagates.
_BUILD_ERRORS = (AssertionError, ValueError, KeyError, IndexError, TypeError)


@dataclass(frozen=True)
class ChainLink:
    """One call of a chain and the prompt ids added since its parent's prompt+generation."""

    entry: TokenEntry
    interstitial: list[int]


@dataclass(frozen=True)
class Chain:
    """One trajectory: a root prompt followed by calls, each extending the previous one."""

    chain_id: str
    links: list[ChainLink]
    root_prompt: list[int]


@dataclass(frozen=True)
class BuildOutput:
    """Chains in leaf order, quarantined call ids in processing order, and the notes."""

    chains: list[Chain]
    quarantined: list[str]
    notes: dict


# --- builders ---------------------------------------------------------------------------


def _processing_key(entry: TokenEntry) -> tuple[int, str]:
    # Shorter prompts first, so every possible parent is processed before its children;
    # the id breaks ties so the order never depends on capture order.
    return (len(entry.prompt_token_ids), entry.model_call_id)


def reference_per_request(entries: Sequence[TokenEntry]) -> BuildOutput:
    """One chain per entry, entries ordered by (prompt length, model_call_id)."""
    ordered = sorted(entries, key=_processing_key)
    chains = []
    for position, entry in enumerate(ordered):
        chains.append(Chain(f"req-{position}", [ChainLink(entry, [])], list(entry.prompt_token_ids)))
    return BuildOutput(chains=chains, quarantined=[], notes={"builder": "per_request", "chains": len(chains)})


def _longest_prefix_matches(
    prompt: list[int],
    cumulative: list[list[int]],
    calls_by_length: dict[int, list[int]],
    lengths: list[int],
) -> list[int]:
    """The processed calls whose cumulative sequence is the longest prefix of `prompt`.

    Returned in processing order; empty when no processed call's cumulative sequence is
    a non-empty prefix of the prompt.
    """
    for length in reversed(lengths):
        if length == 0 or length > len(prompt):
            continue
        prefix = prompt[:length]
        matches = [j for j in calls_by_length[length] if cumulative[j] == prefix]
        if matches:
            return matches
    return []


class _TokenTrie:
    """Cumulative sequences of processed calls, one dict node per token."""

    def __init__(self) -> None:
        self.root: dict = {}

    def insert(self, tokens: list[int], call: int) -> None:
        node = self.root
        for token in tokens:
            node = node.setdefault(token, {})
        node.setdefault("calls", []).append(call)

    def longest_prefix_calls(self, prompt: list[int]) -> list[int]:
        node, found = self.root, []
        for token in prompt:
            node = node.get(token)
            if node is None:
                break
            found = node.get("calls", found)
        return list(found)


def reference_prefix_merging(entries: Sequence[TokenEntry], parent_search: str = "lengths") -> BuildOutput:
    """Merge calls that extend each other into chains (spec section 3, prefix_merging)."""
    entries = list(entries)

    # Step 1: calls that generated nothing carry no training signal and are set aside.
    empty_generation_calls = [e.model_call_id for e in entries if not e.generation_token_ids]
    calls = sorted([e for e in entries if e.generation_token_ids], key=_processing_key)
    n = len(calls)
    captured = sum(len(call.generation_token_ids) for call in calls)

    # Step 2: parents. Indices below are positions in processing order.
    cumulative = [list(call.prompt_token_ids) + list(call.generation_token_ids) for call in calls]
    parent: list[int | None] = [None] * n
    quarantined = [False] * n
    calls_by_length: dict[int, list[int]] = {}
    lengths: list[int] = []  # distinct cumulative lengths of processed calls, ascending
    trie = _TokenTrie()
    for i in range(n):
        if parent_search == "trie":
            matches = trie.longest_prefix_calls(calls[i].prompt_token_ids)
            trie.insert(cumulative[i], i)
        else:
            matches = _longest_prefix_matches(calls[i].prompt_token_ids, cumulative, calls_by_length, lengths)
        if matches:
            parent[i] = matches[0]
            # Several calls produced exactly this history: which one the child continued
            # cannot be known, so training on it would be a guess.
            if len(matches) > 1:
                quarantined[i] = True
        length = len(cumulative[i])
        if length not in calls_by_length:
            calls_by_length[length] = []
            bisect.insort(lengths, length)
        calls_by_length[length].append(i)

    roots = sum(1 for p in parent if p is None)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        if parent[i] is not None:
            children[parent[i]].append(i)

    # Step 3: retry resolution. Calls are grouped by parent (all roots form one group);
    # inside a group, calls with identical prompts are retry siblings. Groups are resolved
    # in the processing order of their first member, which is top-down (a child is always
    # processed after its parent); a group's sibling sets in the order of their first
    # member. Dict insertion order gives both orders.
    groups: dict[int | None, dict[tuple, list[int]]] = {}
    for i in range(n):
        groups.setdefault(parent[i], {}).setdefault(tuple(calls[i].prompt_token_ids), []).append(i)
    sibling_sets = [members for group in groups.values() for members in group.values()]
    unresolved_retries: list[str] = []
    for members in sibling_sets:
        if len(members) < 2:
            continue
        continued = [m for m in members if any(not quarantined[c] for c in children[m])]
        if continued:
            kept = continued
        else:
            # Nothing shows which attempt the rollout went on with: keep one
            # deterministically and report the whole set.
            kept = [min(members, key=lambda m: calls[m].model_call_id)]
            unresolved_retries.extend(calls[m].model_call_id for m in members)
        for m in members:
            if m not in kept:
                quarantined[m] = True

    # Step 4: one path per leaf, root first; a path through a quarantined call is dropped.
    paths: list[list[int]] = []
    for leaf in range(n):
        if children[leaf]:
            continue
        path = []
        node: int | None = leaf
        while node is not None:
            path.append(node)
            node = parent[node]
        path.reverse()
        if any(quarantined[m] for m in path):
            continue
        paths.append(path)

    # Step 5: the delivered chain starts at the earliest root; ties go to chain order.
    main_position = None
    if paths:
        main_position = min(
            range(len(paths)),
            key=lambda k: (calls[paths[k][0]].created_at, calls[paths[k][0]].model_call_id, k),
        )
    chains = []
    branch_count = 0
    for k, path in enumerate(paths):
        if k == main_position:
            chain_id = "main"
        else:
            chain_id = f"branch-{branch_count}"
            branch_count += 1
        links = [ChainLink(calls[path[0]], [])]
        for m in path[1:]:
            parent_length = len(cumulative[parent[m]])
            links.append(ChainLink(calls[m], list(calls[m].prompt_token_ids[parent_length:])))
        chains.append(Chain(chain_id, links, list(calls[path[0]].prompt_token_ids)))

    # Step 6: notes.
    delivered = 0
    if main_position is not None:
        delivered = sum(len(calls[m].generation_token_ids) for m in paths[main_position])
    notes = {
        "builder": "prefix_merging",
        "roots": roots,
        "chains": len(chains),
        "generated_tokens_captured": captured,
        "generated_tokens_delivered": delivered,
        "delivered_fraction": round(delivered / captured, 4) if captured else 0.0,
        "unresolved_retries": unresolved_retries,
        "empty_generation_calls": empty_generation_calls,
    }
    quarantined_ids = [calls[i].model_call_id for i in range(n) if quarantined[i]]
    return BuildOutput(chains=chains, quarantined=quarantined_ids, notes=notes)


def reference_run_builder(name: str, entries: Sequence[TokenEntry], parent_search: str = "lengths") -> BuildOutput:
    """Run the builder called `name`; an unknown name is a ValueError listing the known ones."""
    if name == "per_request":
        return reference_per_request(entries)
    if name == "prefix_merging":
        return reference_prefix_merging(entries, parent_search)
    raise ValueError(f"unknown builder {name!r}; known builders: {', '.join(KNOWN_BUILDERS)}")


# --- projection -------------------------------------------------------------------------


def _carrier_positions(entry: TokenEntry, items: list[dict]) -> list[int]:
    """Which of a call's (non-empty) output items receive its token arrays."""
    index = entry.token_item_index
    if index is not None and 0 <= index < len(items):
        return [index]
    # Older records kept the arrays inline on the item that carried them.
    inline = [k for k, item in enumerate(items) if item.get("generation_token_ids") is not None]
    if inline:
        return inline
    return [len(items) - 1]


def _token_fields(prompt: list[int], entry: TokenEntry) -> dict:
    fields: dict[str, Any] = {
        "prompt_token_ids": list(prompt),
        "generation_token_ids": list(entry.generation_token_ids),
        "generation_log_probs": list(entry.generation_log_probs),
    }
    if entry.routed_experts is not None:
        fields["routed_experts"] = entry.routed_experts
    return fields


def reference_project_chain(chain: Chain) -> list[dict]:
    """The Responses output items of one chain, token arrays restored on each carrier."""
    output: list[dict] = []
    running = list(chain.root_prompt)
    for link in chain.links:
        entry = link.entry
        running = running + list(link.interstitial)
        items = [dict(item) for item in entry.output_items]
        if not items:
            output.append({"type": "message", **_token_fields(running, entry)})
        else:
            for position in _carrier_positions(entry, items):
                items[position].update(_token_fields(running, entry))
            output.extend(items)
        running = running + list(entry.generation_token_ids)
    return output


def _is_token_bearing(item: dict) -> bool:
    return item.get("generation_token_ids") is not None


def _main_chain(build: BuildOutput) -> Chain:
    for chain in build.chains:
        if chain.chain_id == "main":
            return chain
    return build.chains[0]


def reference_project_response(rollout_id: str, build: BuildOutput, model: str) -> dict:
    """The single Responses payload of a build's delivered chain (spec section 4)."""
    if not build.chains:
        raise ValueError("capture produced no safe trainable chain")
    if build.notes.get("builder") == "per_request" and len(build.chains) > 1:
        raise ValueError(
            f"per_request produced {len(build.chains)} chains; single-response delivery needs exactly one"
        )
    items = reference_project_chain(_main_chain(build))
    if not any(item.get("generation_token_ids") for item in items):
        raise ValueError("capture produced no trainable generated tokens")
    token_bearing = [item for item in items if _is_token_bearing(item)]
    usage = {
        "input_tokens": len(token_bearing[0]["prompt_token_ids"]),
        "output_tokens": sum(len(item["generation_token_ids"]) for item in token_bearing),
    }
    return {"id": f"proj-{rollout_id}", "model": model, "object": "response", "output": items, "usage": usage}


def reference_assert_prefix_contiguity(items: list[dict]) -> None:
    """Every token-bearing item's prompt starts with the previous one's prompt + generation."""
    seen: list[int] = []
    for item in items:
        if not _is_token_bearing(item):
            continue
        prompt = list(item.get("prompt_token_ids") or [])
        if prompt[: len(seen)] != seen:
            raise AssertionError("projection is not prefix-contiguous")
        seen = prompt + list(item["generation_token_ids"])


# --- consumer ---------------------------------------------------------------------------


def reference_failed_build(rollout_id: str, builder: str, error: str, n_calls: int = 0) -> dict:
    """A masked build that records why it failed."""
    return {
        "rollout_id": rollout_id,
        "builder": builder,
        "rebuilt_response": None,
        "mask_sample": True,
        "error": error,
        "metrics": {"n_calls": n_calls},
    }


def _validate_chains(build: BuildOutput) -> None:
    for chain in build.chains:
        for link in chain.links:
            entry = link.entry
            if len(entry.generation_log_probs) != len(entry.generation_token_ids):
                raise ValueError(
                    f"call {entry.model_call_id} has {len(entry.generation_log_probs)} log probs for "
                    f"{len(entry.generation_token_ids)} generated ids"
                )


def reference_assemble(
    rollout_id: str, entries: Sequence[TokenEntry], builder: str, model: str, parent_search: str = "lengths"
) -> dict:
    """Build, project and check one rollout; a failure is a masked build, never a raise."""
    entries = list(entries)
    n_calls = len(entries)
    if builder == "per_request":
        return reference_failed_build(rollout_id, builder, PER_REQUEST_UNSUPPORTED, n_calls)
    try:
        build = reference_run_builder(builder, entries, parent_search)
        _validate_chains(build)
        response = reference_project_response(rollout_id, build, model)
        reference_assert_prefix_contiguity(response["output"])
    except _BUILD_ERRORS as error:
        logger.warning("rollout %s: token capture build failed: %s: %s", rollout_id, type(error).__name__, error)
        return reference_failed_build(rollout_id, builder, f"{type(error).__name__}: {error}", n_calls)

    notes = build.notes
    quarantined = len(build.quarantined)
    metrics = {
        "n_calls": n_calls,
        "chains": notes["chains"],
        "roots": notes["roots"],
        "quarantined_calls": quarantined,
        "quarantined_fraction": round(quarantined / n_calls, 4),
        "delivered_fraction": notes["delivered_fraction"],
        "generated_tokens_captured": notes["generated_tokens_captured"],
        "generated_tokens_delivered": notes["generated_tokens_delivered"],
        "empty_generation_calls": len(notes["empty_generation_calls"]),
    }
    unresolved = list(notes["unresolved_retries"])
    mask_sample = bool(unresolved) or notes["roots"] != 1 or notes["chains"] != 1
    return {
        "rollout_id": rollout_id,
        "builder": builder,
        "rebuilt_response": response,
        "metrics": metrics,
        "mask_sample": mask_sample,
        "unresolved_retries": unresolved,
    }


def reference_trajectories_for_rollout(
    rollout_id: str,
    dirs: Sequence[Any],
    *,
    builder: str = "prefix_merging",
    model: str = "",
    parent_search: str = "lengths",
) -> dict | None:
    """Freeze the rollout in the first capture directory and assemble it (spec section 5)."""
    if not dirs:
        return None
    # Imported here so the reference builders stay usable without the store.
    from raycap.capture.store import TokenCaptureStore

    try:
        frozen = TokenCaptureStore(dirs[0]).freeze_raw(rollout_id)
        # Records are read the plain way, one pydantic validation per line.
        entries = [TokenEntry.model_validate(loads_line(line)) for line in iter_lines(frozen.data)]
    except Exception as error:  # a capture that cannot be frozen is a masked result
        return reference_failed_build(rollout_id, builder, f"{type(error).__name__}: {error}")
    snapshot = frozen

    if not entries:
        build = reference_failed_build(rollout_id, builder, "capture contains no token records")
    else:
        build = reference_assemble(rollout_id, entries, builder, model, parent_search)
    if snapshot.incomplete:
        build["mask_sample"] = True
        build["metrics"]["capture_incomplete"] = True
    build["_capture_snapshot"] = {"snapshot_id": snapshot.snapshot_id, "version": snapshot.version}
    return build
