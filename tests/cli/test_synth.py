"""The synthetic corpus generator: deterministic, realistic, every shape on disk as named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from raycap.capture.records import TokenEntry, parse_entries
from raycap.capture.store import TokenCaptureStore
from raycap.cli.synth import NORMAL, SHAPES, CorpusSpec, generate_corpus, long_rollout, main

# Small token ranges keep every test fast; the shapes and chaining do not depend on sizes.
SMALL = dict(system_tokens=(20, 60), turns=(4, 8), generation_tokens=(2, 20), tool_tokens=(1, 30))
ITEM_TYPES = {"reasoning", "function_call", "message"}


def _entries(directory: Path, rollout_id: str) -> list[TokenEntry]:
    return parse_entries((directory / f"{rollout_id}.tokens.jsonl").read_bytes())


def _files(directory: Path) -> dict[str, object]:
    """Every file of the directory; the random snapshot id of frozen states is left out."""
    out: dict[str, object] = {}
    for path in sorted(directory.iterdir()):
        if path.name.endswith(".state.json"):
            state = json.loads(path.read_bytes())
            state.pop("snapshot_id")
            out[path.name] = state
        else:
            out[path.name] = path.read_bytes()
    return out


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    """Every shape once (and one twice), written through the real store."""
    directory = tmp_path_factory.mktemp("shaped")
    spec = CorpusSpec(rollouts=len(SHAPES) + 1, fault_share=1.0, seed=3, **SMALL)
    summary = generate_corpus(directory, spec)
    return directory, summary


@pytest.mark.slow
def test_same_seed_writes_the_same_bytes(tmp_path):
    spec = CorpusSpec(rollouts=len(SHAPES), fault_share=1.0, seed=11, **SMALL)
    first = generate_corpus(tmp_path / "a", spec)
    second = generate_corpus(tmp_path / "b", spec)
    assert (first.rollout_ids, first.shapes, first.calls) == (second.rollout_ids, second.shapes, second.calls)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    generate_corpus(tmp_path / "c", CorpusSpec(rollouts=len(SHAPES), fault_share=1.0, seed=12, **SMALL))
    assert _files(tmp_path / "c") != _files(tmp_path / "a")


def test_a_rollout_does_not_depend_on_the_corpus_size(tmp_path):
    generate_corpus(tmp_path / "few", CorpusSpec(rollouts=2, fault_share=0.0, **SMALL))
    generate_corpus(tmp_path / "more", CorpusSpec(rollouts=5, fault_share=0.0, **SMALL))
    for name in ("r0000.tokens.jsonl", "r0001.tokens.jsonl"):
        assert (tmp_path / "few" / name).read_bytes() == (tmp_path / "more" / name).read_bytes()


@pytest.mark.slow
def test_every_shape_appears_when_every_rollout_is_shaped(shaped):
    _, summary = shaped
    assert set(summary.shapes.values()) == set(SHAPES)
    assert list(summary.shapes) == list(summary.rollout_ids)


@pytest.mark.slow
@pytest.mark.parametrize("share, shaped_count", [(0.0, 0), (0.1, 4), (0.25, 10), (1.0, 40)])
def test_fault_share_sets_how_many_rollouts_are_shaped(tmp_path, share, shaped_count):
    spec = CorpusSpec(rollouts=40, fault_share=share, **{**SMALL, "turns": (4, 4), "tool_tokens": (1, 2)})
    summary = generate_corpus(tmp_path, spec)
    assert sum(shape != NORMAL for shape in summary.shapes.values()) == shaped_count


def _assert_chained(entries: list[TokenEntry]) -> None:
    entries = sorted(entries, key=lambda e: e.created_at)
    for previous, entry in zip(entries, entries[1:]):
        history = previous.prompt_token_ids + previous.generation_token_ids
        assert entry.prompt_token_ids[: len(history)] == history
        assert len(entry.prompt_token_ids) > len(history)
        assert entry.created_at > previous.created_at


def test_normal_rollouts_chain_exactly_by_prefix(tmp_path):
    spec = CorpusSpec(rollouts=6, fault_share=0.0, **SMALL)
    summary = generate_corpus(tmp_path, spec)
    assert set(summary.shapes.values()) == {NORMAL}
    total = 0
    for rollout_id in summary.rollout_ids:
        entries = _entries(tmp_path, rollout_id)
        total += len(entries)
        assert spec.turns[0] <= len(entries) <= spec.turns[1]
        assert len({e.model_call_id for e in entries}) == len(entries)
        _assert_chained(entries)
        for k, entry in enumerate(entries):
            assert entry.rollout_id == rollout_id and entry.model == spec.model
            assert spec.generation_tokens[0] <= len(entry.generation_token_ids) <= spec.generation_tokens[1]
            assert len(entry.generation_log_probs) == len(entry.generation_token_ids)
            assert all(isinstance(lp, float) and lp < 0 for lp in entry.generation_log_probs)
            types = [item["type"] for item in entry.output_items]
            assert set(types) <= ITEM_TYPES
            assert entry.token_item_index == len(types) - 1
            # The last call answers; every other call asks for a tool.
            assert types[-1] == ("message" if k == len(entries) - 1 else "function_call")
            carrier = entry.output_items[entry.token_item_index]
            assert not {"prompt_token_ids", "generation_token_ids", "generation_log_probs"} & set(carrier)
            if types[-1] == "function_call":
                assert carrier["name"] and carrier["call_id"] and json.loads(carrier["arguments"])
            else:
                assert carrier["role"] == "assistant" and carrier["content"][0]["type"] == "output_text"
    assert summary.calls == total


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [151_936, 512])
def test_token_ids_stay_within_the_vocabulary(tmp_path, vocab_size):
    spec = CorpusSpec(rollouts=len(SHAPES), fault_share=1.0, vocab_size=vocab_size, **SMALL)
    generate_corpus(tmp_path, spec)
    seen = 0
    for path in tmp_path.glob("*.tokens.jsonl"):
        for line in path.read_bytes().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the cut-off lines of the damaged shapes
            ids = record["prompt_token_ids"] + record["generation_token_ids"]
            assert 0 <= min(ids) and max(ids) < vocab_size
            seen += 1
    assert seen > 3 * len(SHAPES)


@pytest.mark.slow
def test_a_default_sized_corpus_has_the_expected_size(tmp_path):
    # 120 default rollouts are about 230 MB, so 10 are about 19 MB; seeds vary it.
    summary = generate_corpus(tmp_path, CorpusSpec(rollouts=10, seed=5))
    on_disk = sum(path.stat().st_size for path in tmp_path.iterdir())
    assert summary.bytes_written == on_disk
    assert 8e6 < on_disk < 35e6
    assert 40 <= summary.calls <= 400


# What each shape leaves on disk, checked through the real store.


def _check_shape(store: TokenCaptureStore, rollout_id: str, shape: str) -> None:
    paths = store.paths(rollout_id)
    if shape == "retired":
        assert not paths.jsonl.exists() and json.loads(paths.state.read_bytes())["retired"]
        with pytest.raises(RuntimeError, match="retired"):
            store.freeze_now(rollout_id)
        return
    raw = paths.jsonl.read_bytes()
    if shape == "frozen":
        state = json.loads(paths.state.read_bytes())
        assert state["frozen"] and state["snapshot_id"]
        assert store.freeze_now(rollout_id).snapshot_id == state["snapshot_id"]
        return
    if shape == "torn_final_line":
        assert not raw.endswith(b"\n")
        snapshot = store.freeze_now(rollout_id)  # the torn write is cut off
        assert paths.jsonl.read_bytes() == raw[: raw.rindex(b"\n") + 1]
        _assert_chained(list(snapshot.entries))
        return
    if shape == "corrupt_middle_line":
        with pytest.raises(json.JSONDecodeError):
            store.freeze_now(rollout_id)
        return
    if shape in ("newer_schema", "logprob_mismatch"):
        last = json.loads(raw.splitlines()[-1])
        if shape == "newer_schema":
            assert last["schema_version"] == 2
        else:
            assert len(last["generation_log_probs"]) == len(last["generation_token_ids"]) - 1
        with pytest.raises(ValidationError):
            store.freeze_now(rollout_id)
        return

    entries = parse_entries(raw)
    snapshot = store.freeze_now(rollout_id)
    assert snapshot.incomplete == (shape in ("lost_call", "mark_incomplete"))
    assert len(snapshot.entries) == len(entries)
    prompts = [tuple(e.prompt_token_ids) for e in entries]
    if shape in ("retry_resolved", "retry_unresolved", "retry_first_call", "empty_generation"):
        retried = [p for p in set(prompts) if prompts.count(p) == 2]
        assert len(retried) == 1
        pair = [e for e in entries if tuple(e.prompt_token_ids) == retried[0]]
        assert pair[0].generation_token_ids != pair[1].generation_token_ids
        if shape == "empty_generation":
            assert sorted(len(e.generation_token_ids) for e in pair)[0] == 0
        if shape == "retry_first_call":
            assert len(retried[0]) == min(len(p) for p in prompts)
        if shape == "retry_unresolved":
            assert len(retried[0]) == max(len(p) for p in prompts)
    elif shape == "identical_parents":
        sequences = [tuple(e.prompt_token_ids + e.generation_token_ids) for e in entries]
        assert len(set(sequences)) == len(sequences) - 1
    elif shape in ("subagent_branch", "compaction", "side_call"):
        assert len(set(prompts)) == len(prompts)
        sequences = [e.prompt_token_ids + e.generation_token_ids for e in entries]
        continued = [any(o.prompt_token_ids[: len(seq)] == seq for o in entries) for seq in sequences]
        assert continued.count(False) == 2  # two conversations end: the main one and the other
    elif shape == "lost_call":
        intents = paths.intents.read_text().split()
        assert len(intents) == len(entries) + 1
        assert len(set(intents) - {e.model_call_id for e in entries}) == 1
    elif shape == "mark_incomplete":
        (failed,) = paths.incomplete.read_text().split()
        assert failed not in {e.model_call_id for e in entries}
    elif shape == "legacy_inline":
        for entry in entries:
            assert entry.token_item_index is None
            carrier = entry.output_items[-1]
            assert carrier["prompt_token_ids"] == entry.prompt_token_ids
            assert carrier["generation_token_ids"] == entry.generation_token_ids
            assert carrier["generation_log_probs"] == entry.generation_log_probs
        _assert_chained(entries)
    elif shape == "routed_experts":
        for entry in entries:
            assert len(entry.routed_experts) == len(entry.generation_token_ids)
        _assert_chained(entries)
    else:
        raise AssertionError(f"no check for shape {shape}")


@pytest.mark.slow
def test_each_shape_leaves_the_evidence_it_is_named_for(shaped):
    directory, summary = shaped
    store = TokenCaptureStore(directory)
    for rollout_id, shape in summary.shapes.items():
        _check_shape(store, rollout_id, shape)


@pytest.mark.slow
def test_long_rollout_is_one_chain_of_a_thousand_calls(tmp_path):
    summary = long_rollout(tmp_path, "long-7", seed=1)
    assert summary.rollout_ids == ("long-7",) and summary.calls == 1000
    assert summary.bytes_written < 40e6
    entries = _entries(tmp_path, "long-7")
    assert len(entries) == 1000
    _assert_chained(entries)


def test_existing_captures_are_never_overwritten(tmp_path):
    spec = CorpusSpec(rollouts=2, fault_share=0.0, **SMALL)
    generate_corpus(tmp_path, spec)
    with pytest.raises(FileExistsError, match="r0000"):
        generate_corpus(tmp_path, spec)
    generate_corpus(tmp_path, CorpusSpec(rollouts=2, fault_share=0.0, id_prefix="other-", **SMALL))


@pytest.mark.parametrize(
    "bad",
    [
        dict(turns=(2, 8)),
        dict(generation_tokens=(9, 3)),
        dict(fault_share=1.5),
        dict(id_prefix="a/b"),
        dict(vocab_size=8),
    ],
)
def test_an_invalid_spec_is_refused_before_writing(tmp_path, bad):
    with pytest.raises(ValueError):
        generate_corpus(tmp_path / "out", CorpusSpec(rollouts=2, **{**SMALL, **bad}))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_cli_prints_a_one_line_summary(tmp_path, capsys):
    assert main([str(tmp_path / "out"), "--rollouts", "3", "--seed", "2", "--fault-share", "0.5"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("wrote 3 rollouts (2 shaped)") and str(tmp_path / "out") in line
    assert main([str(tmp_path / "out"), "--rollouts", "3"]) == 2
    assert "already has capture files" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_runs_as_a_module(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "raycap.cli.synth", str(tmp_path), "--rollouts", "1", "--fault-share", "0"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert done.stdout.startswith("wrote 1 rollouts (0 shaped)")
    assert (tmp_path / "r0000.tokens.jsonl").exists()
