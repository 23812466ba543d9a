"""The fast builders and consumer against the reference implementation of the spec.

tests/reference.py is the slow, obviously correct reading of SPEC sections 3-5; the fast
path (prefix hashes, numpy projection, span-based contiguity, the numpy record reader)
must agree with it exactly on random rollouts with retries, branches, compaction, side
calls, empty generations, identical parents, odd output items and shuffled order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raycap.capture.records
from raycap.capture import builder as builders
from raycap.capture.builder import per_request, prefix_merging, run_builder
from raycap.capture.consumer import _assemble, assemble
from raycap.capture.records import TokenEntry, entry_line, parse_records
from reference import reference_assemble, reference_run_builder
from strategies import examples, rollouts

SETTINGS = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _notes(notes) -> dict:
    """The reference keeps its notes as the dict of what the builder records: everything
    for prefix_merging, only builder and chains for per_request."""
    if isinstance(notes, dict):
        return notes
    if notes.builder == "per_request":
        return {"builder": notes.builder, "chains": notes.chains}
    return dataclasses.asdict(notes)


def _shape(build) -> tuple:
    chains = [
        (c.chain_id, list(map(int, c.root_prompt)), [(l.entry.model_call_id, list(map(int, l.interstitial))) for l in c.links])
        for c in build.chains
    ]
    return chains, list(build.quarantined), _notes(build.notes)


def _error_kind(build: dict) -> dict:
    # Error texts may word the detail differently; the exception type and the spec's
    # fixed phrase are the contract.
    build = dict(build)
    if "error" in build:
        kind, _, rest = build["error"].partition(": ")
        for phrase in (
            "projection is not prefix-contiguous",
            "capture produced no safe trainable chain",
            "capture produced no trainable generated tokens",
            "per_request returns multiple trajectories",
        ):
            if phrase in rest:
                rest = phrase
        build["error"] = (kind, rest if kind != "KeyError" else rest)
    return build


@contextlib.contextmanager
def _direct_max_calls(calls: int):
    """Up to how many calls prefix_merging finds parents without hashes, for a while."""
    before = builders.DIRECT_MAX_CALLS
    builders.DIRECT_MAX_CALLS = calls
    try:
        yield
    finally:
        builders.DIRECT_MAX_CALLS = before


# One property test for every fast path against the reference: drawing a rollout costs
# far more than checking it, so each drawn rollout goes through every path here.
@SETTINGS
@given(rollouts(), st.randoms(use_true_random=False), st.booleans(), st.sampled_from(["prefix_merging", "per_request"]))
def test_every_builder_the_record_reader_and_assemble_match_the_reference(entries, rnd, made_order, builder):
    """- prefix_merging, per_request and the benchmark's token-trie baseline (the same
      builder, only slower) build what the reference builds;
    - assemble gives the reference's build in any capture order;
    - serialised, parsed with the numpy reader and built, the records give what the
      entries themselves give;
    - the reader keeps prompts that extend each other in one buffer, and the builders
      then skip comparing and hashing what the prompts share (CallArrays.home). In the
      order the agent made the calls most prompts extend the line before; shuffled, some
      do. Either way the build is the reference's."""
    reference = _shape(reference_run_builder("prefix_merging", entries))
    assert _shape(prefix_merging(entries)) == reference, "prefix_merging"
    for direct_max, way in ((0, "parents through prefix hashes"), (len(entries), "parents compared directly")):
        with _direct_max_calls(direct_max):
            assert _shape(prefix_merging(entries)) == reference, way
    assert _shape(reference_run_builder("prefix_merging", entries, "trie")) == reference, "the trie baseline"
    assert _shape(per_request(entries)) == _shape(reference_run_builder("per_request", entries)), "per_request"

    expected = _error_kind(reference_assemble("r-1", entries, "prefix_merging", "m"))
    shuffled = list(entries)
    rnd.shuffle(shuffled)
    assert _error_kind(_assemble("r-1", shuffled, "prefix_merging", "m")) == expected, "assemble in another order"

    data = b"".join(entry_line(e) + b"\n" for e in entries)
    records = parse_records(data)
    assert [e for e, _ in records] == entries
    for (entry, arrays) in records:
        assert arrays.prompt.tolist() == entry.prompt_token_ids
        assert arrays.generation.tolist() == entry.generation_token_ids
        assert arrays.log_probs.tolist() == entry.generation_log_probs
    parsed = [e for e, _ in records]
    assert _error_kind(_assemble("r-2", parsed, "prefix_merging", "")) == _error_kind(
        reference_assemble("r-2", entries, "prefix_merging", "")
    ), "read back through the numpy reader"

    ordered = sorted(entries, key=lambda e: (len(e.prompt_token_ids), e.model_call_id)) if made_order else entries
    records = parse_records(b"".join(entry_line(e) + b"\n" for e in ordered), prompt_lists=False)
    got = assemble("r-3", [e for e, _ in records], builder, "", [a for _, a in records]).to_build()
    assert _error_kind(got) == _error_kind(reference_assemble("r-3", ordered, builder, "")), "prompts sharing a buffer"


def test_the_row_path_projects_through_arrays_and_never_makes_token_lists():
    """Chain.root_prompt and ChainLink.interstitial read as lists, but the bulk path
    builds and projects without reading them, so no per-token list is made."""
    prompt, entries = [1, 2, 3], []
    for k in range(4):
        entries.append(_entry(f"c{k}", prompt, [10 + k]))
        prompt = prompt + [10 + k, 20 + k]
    records = parse_records(b"".join(entry_line(e) + b"\n" for e in entries), prompt_lists=False)
    result = assemble("r", [e for e, _ in records], "prefix_merging", "", [a for _, a in records])
    result.to_build()

    chain = result.build.chains[0]
    stored = [chain.__dict__["_root_prompt_ids"], *(link.__dict__["_interstitial_ids"] for link in chain.links)]
    assert all(isinstance(ids, np.ndarray) for ids in stored)
    # Read through the public attributes they are lists, and stay consistent with the arrays.
    assert chain.root_prompt == [1, 2, 3] and chain.links[1].interstitial == [20]
    assert chain.links[1].interstitial_array.tolist() == [20]


def test_the_reader_shares_prompt_memory_along_an_agent_loop(monkeypatch):
    # Prompts this short are parsed whole by default (PREFIX_MIN_BYTES); long ones share.
    monkeypatch.setattr(raycap.capture.records, "PREFIX_MIN_BYTES", 0)
    prompt, entries = [1, 2, 3], []
    for k in range(5):
        entries.append(_entry(f"c{k}", prompt, [10 + k]))
        prompt = prompt + [10 + k, 20 + k]
    records = parse_records(b"".join(entry_line(e) + b"\n" for e in entries), prompt_lists=False)
    homes = {id(arrays.home) for _, arrays in records}
    assert len(homes) == 1 and all(arrays.home is not None for _, arrays in records)
    for entry, (_, arrays) in zip(entries, records):
        assert arrays.prompt.tolist() == entry.prompt_token_ids
    build = assemble("r", [e for e, _ in records], "prefix_merging", "", [a for _, a in records]).to_build()
    assert build == reference_assemble("r", entries, "prefix_merging", "")
    assert build["mask_sample"] is False


@pytest.mark.parametrize("direct_max", [0, 10], ids=["through-hashes", "compared-directly"])
def test_one_home_never_stands_in_for_different_tokens(monkeypatch, direct_max):
    """With every hash colliding (or no hashes), parents are decided by comparison;
    prompts with one home skip only the comparison of memory they share."""
    monkeypatch.setattr(builders, "_WEIGHTS", np.zeros(1 << 16, dtype=np.uint64))
    monkeypatch.setattr(builders, "DIRECT_MAX_CALLS", direct_max)
    entries = [
        _entry("a", [1, 2], [3]),
        _entry("b", [1, 2, 3, 7], [8]),
        _entry("c", [1, 2, 3, 7, 8, 9], [4]),
        _entry("d", [1, 2, 3, 7, 9, 9], [4]),  # same lengths as c, not c's continuation
        _entry("e", [1, 2, 3, 7, 8, 9, 4, 5], [6]),
    ]
    records = parse_records(b"".join(entry_line(e) + b"\n" for e in entries), prompt_lists=False)
    got = assemble("r", [e for e, _ in records], "prefix_merging", "", [a for _, a in records]).to_build()
    assert _error_kind(got) == _error_kind(reference_assemble("r", entries, "prefix_merging", ""))


def _entry(call_id, prompt, gen, created_at=0.0, **kw):
    return TokenEntry(
        rollout_id="r",
        model_call_id=call_id,
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=[-0.5] * len(gen),
        created_at=created_at,
        **kw,
    )


def test_hash_collision_never_picks_a_wrong_parent(monkeypatch):
    """With every position weight zero all prefixes collide; exact verification decides."""
    monkeypatch.setattr(builders, "_WEIGHTS", np.zeros(1 << 16, dtype=np.uint64))
    monkeypatch.setattr(builders, "DIRECT_MAX_CALLS", 0)  # through the hashes, however few the calls
    entries = [
        _entry("a", [1, 2], [3]),
        _entry("b", [9, 9], [9]),  # same lengths, different tokens
        _entry("c", [1, 2, 3, 4], [5]),
        _entry("d", [9, 9, 9, 7], [5]),
    ]
    assert _shape(prefix_merging(entries)) == _shape(reference_run_builder("prefix_merging", entries))
    build = prefix_merging(entries)
    parents = {c.links[-1].entry.model_call_id: c.links[0].entry.model_call_id for c in build.chains}
    assert parents == {"c": "a", "d": "b"}


@pytest.mark.slow
def test_thousand_call_rollout_with_branches_matches_reference():
    rng = random.Random(7)
    entries, seq = [], [1, 2, 3]
    for i in range(1200):
        gen = [rng.randrange(50_000) for _ in range(rng.randrange(1, 20))]
        entries.append(_entry(f"c{i:04d}", list(seq), gen, created_at=float(i)))
        if i % 97 == 5:  # a sub-agent branch off this call
            entries.append(_entry(f"s{i:04d}", list(seq) + gen + [7], [8, 9], created_at=float(i)))
        seq = seq + gen + [rng.randrange(50_000) for _ in range(rng.randrange(1, 10))]
    rng.shuffle(entries)
    fast = prefix_merging(entries)
    assert _shape(fast) == _shape(reference_run_builder("prefix_merging", entries))
    assert fast.notes.chains > 1
    # Every chain shares the root, so `main` is the first chain in leaf order: the
    # earliest sub-agent branch, not the long conversation (SPEC section 3, step 5).
    assert fast.chains[0].chain_id == "main"
    assert fast.chains[0].links[-1].entry.model_call_id == "s0005"
    assert max(len(c.links) for c in fast.chains) == 1200


def test_unknown_builder_lists_known_ones():
    with pytest.raises(ValueError, match="per_request, prefix_merging"):
        run_builder([], "nope")


def test_inline_legacy_item_outside_the_carrier_is_checked_on_items():
    """A non-carrier item that still carries its own arrays takes the item-level path."""
    stray = {"type": "message", "prompt_token_ids": [5], "generation_token_ids": [6], "generation_log_probs": [-1.0]}
    entries = [
        _entry("a", [1, 2], [3], output_items=[stray, {"type": "message"}], token_item_index=1),
    ]
    result = _assemble("r", entries, "prefix_merging", "")
    assert result["error"].startswith("AssertionError: projection is not prefix-contiguous")
    assert _error_kind(result) == _error_kind(reference_assemble("r", entries, "prefix_merging", ""))


def test_a_rollout_of_a_few_calls_is_chained_without_hashing_its_prompts(monkeypatch):
    """Up to DIRECT_MAX_CALLS calls, candidates are compared directly (a step's small
    rollouts): no prefix hash is made, and the build is the reference's."""
    def no_hashes(*args, **kwargs):
        raise AssertionError("hashed the prompts of a rollout of a few calls")

    monkeypatch.setattr(builders, "_prefix_hashes", no_hashes)
    entries = [
        _entry("a", [1, 2], [3]),
        _entry("b", [1, 2, 3, 4], [5]),
        _entry("c", [1, 2, 3, 4], [6]),  # a retry of b, not continued
        _entry("d", [1, 2, 3, 4, 5, 7], [8]),
    ][: builders.DIRECT_MAX_CALLS]
    build = prefix_merging(entries)
    assert _shape(build) == _shape(reference_run_builder("prefix_merging", entries))
    assert [[link.entry.model_call_id for link in chain.links] for chain in build.chains] == [["a", "b", "d"]]
    assert build.quarantined == ["c"]


def test_a_build_that_grows_the_weight_table_keeps_the_hashes_it_made(monkeypatch):
    """Weights are extended when a build meets a longer sequence than any before. Hashes
    of the earlier calls, cached in the build, must still match, so the growth keeps every
    weight it had: a call past the old table's end is still chained to its parent."""
    monkeypatch.setattr(builders, "_WEIGHTS", np.empty(0, dtype=np.uint64))
    monkeypatch.setattr(builders, "DIRECT_MAX_CALLS", 0)  # two calls, through the hashes
    first = builders._weights(4).copy()
    assert len(first) >= 4 and (first % 2 == 1).all() and len(set(first.tolist())) == len(first)
    size = len(first)
    short = list(range(1, 11))
    entries = [
        _entry("a", short, [11]),
        _entry("b", [*short, 11, *range(12, size + 20)], [7]),  # past the table's end
    ]
    build = prefix_merging(entries)
    assert len(builders._WEIGHTS) > size
    assert (builders._WEIGHTS[:size] == first).all()
    assert [[link.entry.model_call_id for link in chain.links] for chain in build.chains] == [["a", "b"]]


def test_building_imports_no_numpy_random():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from raycap.capture.builder import prefix_merging\n"
        "from raycap.capture.records import TokenEntry\n"
        "e = [TokenEntry(rollout_id='r', model_call_id='a', prompt_token_ids=[1, 2], generation_token_ids=[3],"
        " generation_log_probs=[-0.5], created_at=0.0)]\n"
        "prefix_merging(e)\n"
        "print('numpy.random' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"]
