"""Code written against NeMo Gym's `nemo_gym.token_id_capture` runs unchanged on raycap.

Each test imports raycap the way a team that swaps it in does: through an import alias
that maps `nemo_gym.token_id_capture` and its submodules onto raycap's modules of the
same names. The tests then use only NeMo Gym's names and shapes (SPEC section 9).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gym_alias import SUBMODULES, nemo_gym_alias  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("nemo_gym_alias")


def _entry(call_id, prompt, gen, created_at=0.0):
    from nemo_gym.token_id_capture.records import TokenEntry

    return TokenEntry(
        rollout_id="t0-r0",
        model_call_id=call_id,
        model="m",
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=[-0.5] * len(gen),
        created_at=created_at,
    )


def _three_turns():
    return [
        _entry("c1", [1, 2, 3], [10, 11]),
        _entry("c2", [1, 2, 3, 10, 11, 4, 5], [12]),
        _entry("c3", [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14]),
    ]


# -- builders -------------------------------------------------------------------------------


def test_build_notes_are_typed_fields_not_a_dict():
    from nemo_gym.token_id_capture import prefix_merging

    side = _entry("side", [90, 91], [92, 93], created_at=5.0)
    out = prefix_merging([*_three_turns(), side, _entry("empty", [1], [])])

    assert dataclasses.is_dataclass(out.notes)
    assert out.notes.builder == "prefix_merging"
    assert out.notes.roots == 2
    assert out.notes.chains == 2
    assert out.notes.generated_tokens_captured == 7
    assert out.notes.generated_tokens_delivered == 5
    assert out.notes.delivered_fraction == round(5 / 7, 4)
    assert out.notes.unresolved_retries == []
    assert out.notes.empty_generation_calls == ["empty"]
    with pytest.raises(TypeError):
        out.notes["chains"]  # a renamed or dict-style read fails loudly


def test_chain_links_carry_interstitial_and_root_prompt_as_lists_of_ints():
    from nemo_gym.token_id_capture import prefix_merging

    chain = prefix_merging(_three_turns()).chains[0]

    assert chain.chain_id == "main"
    assert chain.root_prompt == [1, 2, 3] and type(chain.root_prompt) is list
    assert [link.interstitial for link in chain.links] == [[], [4, 5], [6]]
    assert all(type(link.interstitial) is list for link in chain.links)
    assert all(type(token) is int for link in chain.links for token in link.interstitial)
    assert [link.entry.model_call_id for link in chain.links] == ["c1", "c2", "c3"]


def test_a_hand_made_chain_projects_like_a_built_one():
    from nemo_gym.token_id_capture import builder, prefix_merging, project_chain_to_output_items

    entries = _three_turns()
    built = prefix_merging(entries).chains[0]
    by_hand = builder.Chain(
        chain_id="main",
        links=[builder.ChainLink(entry=e, interstitial=i) for e, i in zip(entries, ([], [4, 5], [6]))],
        root_prompt=[1, 2, 3],
    )

    assert by_hand == built
    assert project_chain_to_output_items(by_hand) == project_chain_to_output_items(built)


def test_per_request_records_builder_and_chains_and_raycap_never_reads_its_defaults_as_measured():
    from nemo_gym.token_id_capture import per_request

    from raycap.rows.chains import assemble_chains

    out = per_request(_three_turns())

    assert (out.notes.builder, out.notes.chains) == ("per_request", 3)
    assert [c.chain_id for c in out.chains] == ["req-0", "req-1", "req-2"]
    # Chain delivery reports per_request's roots as unknown, not as zero roots.
    assert assemble_chains("t0-r0", _three_turns(), "per_request", "m").rollout.metrics.roots is None


def test_run_builder_takes_entries_first_and_defaults_to_prefix_merging():
    from nemo_gym.token_id_capture import run_builder

    assert run_builder(_three_turns()).notes.builder == "prefix_merging"
    assert run_builder(_three_turns(), builder="per_request").notes.builder == "per_request"
    with pytest.raises(ValueError, match="per_request, prefix_merging"):
        run_builder(_three_turns(), "longest")


# -- contiguity -----------------------------------------------------------------------------


def test_assert_prefix_contiguity_walks_the_response_output_and_raises_on_a_gap():
    from nemo_gym.token_id_capture import assert_prefix_contiguity

    gap = {
        "output": [
            {"type": "message", "prompt_token_ids": [1, 2], "generation_token_ids": [3]},
            {"type": "message", "content": "no tokens here"},
            {"type": "message", "prompt_token_ids": [1, 2, 9], "generation_token_ids": [4]},
        ]
    }
    with pytest.raises(AssertionError, match="prefix-contiguous"):
        assert_prefix_contiguity(gap)

    gap["output"][2]["prompt_token_ids"] = [1, 2, 3, 9]
    assert_prefix_contiguity(gap)  # extends everything seen before it


def test_assert_prefix_contiguity_passes_a_projected_response():
    from nemo_gym.token_id_capture import assert_prefix_contiguity, prefix_merging, project_main_chain_response

    response = project_main_chain_response("t0-r0", prefix_merging(_three_turns()), model="m")

    assert_prefix_contiguity(response)
    assert response["usage"] == {"input_tokens": 3, "output_tokens": 5}


# -- the store ------------------------------------------------------------------------------


def test_the_store_is_an_async_sink_and_source_with_synchronous_forms(tmp_path):
    from nemo_gym.token_id_capture import TokenSink, TokenSource
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    store = TokenCaptureStore(tmp_path)
    assert isinstance(store, TokenSink) and isinstance(store, TokenSource)
    assert store.root == tmp_path
    assert store.path_for("t0-r0") == tmp_path / "t0-r0.tokens.jsonl"
    assert store.state_path_for("t0-r0") == tmp_path / "t0-r0.tokens.state.json"
    assert store.lock_path_for("t0-r0") == tmp_path / "t0-r0.tokens.lock"
    assert store.intents_path_for("t0-r0") == tmp_path / "t0-r0.tokens.intents"
    assert store.incomplete_path_for("t0-r0") == tmp_path / "t0-r0.tokens.incomplete"
    first, second, third = _three_turns()

    async def writer_then_consumer():
        await store.begin_call("t0-r0", "c2")
        await store.put(first)
        await store.put(second)
        await store.mark_incomplete("t0-r0", "lost")
        snapshot = await store.freeze("t0-r0")
        again = await store.freeze("t0-r0")
        dropped = await store.drop("t0-r0", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        await store.close()
        return snapshot, again, dropped

    snapshot, again, dropped = asyncio.run(writer_then_consumer())

    assert [e.model_call_id for e in snapshot.entries] == ["c1", "c2"]
    assert snapshot.incomplete is True
    assert (again.snapshot_id, again.version) == (snapshot.snapshot_id, snapshot.version)
    assert dropped is True
    with pytest.raises(RuntimeError, match="retired"):
        store.append(third)


def test_the_async_store_methods_do_their_file_work_off_the_event_loop(tmp_path, monkeypatch):
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    store = TokenCaptureStore(tmp_path)
    threads: dict[str, int] = {}
    for name in ("append", "mark_incomplete_now", "begin_call_now", "freeze_now", "drop_now"):
        blocking = getattr(TokenCaptureStore, name)

        def recorded(self, *args, _name=name, _blocking=blocking, **kwargs):
            threads[_name] = threading.get_ident()
            return _blocking(self, *args, **kwargs)

        monkeypatch.setattr(TokenCaptureStore, name, recorded)

    async def use():
        loop = threading.get_ident()
        await store.begin_call("t0-r0", "c1")
        await store.put(_three_turns()[0])
        await store.mark_incomplete("t0-r0")
        snapshot = await store.freeze("t0-r0")
        await store.drop("t0-r0", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        return loop

    loop = asyncio.run(use())
    assert sorted(threads) == ["append", "begin_call_now", "drop_now", "freeze_now", "mark_incomplete_now"]
    assert loop not in threads.values()


def test_a_script_writes_and_freezes_synchronously(tmp_path):
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    store = TokenCaptureStore(tmp_path)
    for entry in _three_turns():
        store.append(entry)
    assert [e.model_call_id for e in store.read_entries("t0-r0")] == ["c1", "c2", "c3"]
    assert store.read_entries("nothing-here") == []

    snapshot = store.freeze_now("t0-r0")
    assert len(snapshot.entries) == 3 and not snapshot.incomplete
    store.delete("t0-r0")
    assert store.read_entries("t0-r0") == []
    assert store.sweep_retired(0) == 0


# -- protocols ------------------------------------------------------------------------------


def test_install_and_installed_hold_one_process_wide_default_each(tmp_path):
    from nemo_gym.token_id_capture.protocols import (
        install_token_sink,
        install_token_source,
        installed_token_sink,
        installed_token_source,
    )
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    sink, source = TokenCaptureStore(tmp_path / "a"), TokenCaptureStore(tmp_path / "b")
    try:
        install_token_sink(sink)
        install_token_source(source)
        assert installed_token_sink() is sink
        assert installed_token_source() is source
        # The consumer's config check sees the same installed sink.
        from nemo_gym.token_id_capture import token_id_capture_dirs_from_config

        assert token_id_capture_dirs_from_config({"token_id_capture": {"enabled": True}}) == []
    finally:
        install_token_sink(None)
        install_token_source(None)
    assert installed_token_sink() is None and installed_token_source() is None


# -- the consumer's seams -------------------------------------------------------------------


class _Source:
    """A caller's TokenSource, as NeMo Gym's tests write one."""

    def __init__(self, entries):
        self.entries = tuple(entries)

    async def freeze(self, rollout_id):
        from nemo_gym.token_id_capture import TokenCaptureSnapshot

        return TokenCaptureSnapshot(
            rollout_id=rollout_id, entries=self.entries, incomplete=False, snapshot_id="s-1", version=3
        )

    async def drop(self, rollout_id, *, snapshot_id, version):
        return True

    async def close(self):
        return None


def test_trajectories_from_source_assembles_through_the_module_seam_in_a_worker_thread(monkeypatch):
    import nemo_gym.token_id_capture.consumer as consumer_module
    from nemo_gym.token_id_capture import trajectories_from_source

    seen = []
    original = consumer_module._assemble

    def spy(rollout_id, entries, builder, model):
        seen.append((rollout_id, len(entries), builder, model, threading.get_ident()))
        return original(rollout_id, entries, builder, model)

    monkeypatch.setattr(consumer_module, "_assemble", spy)

    async def consume():
        return threading.get_ident(), await trajectories_from_source("t0-r0", _Source(_three_turns()), model="m")

    loop, built = asyncio.run(consume())

    assert [call[:4] for call in seen] == [("t0-r0", 3, "prefix_merging", "m")]
    assert seen[0][4] != loop
    assert built["mask_sample"] is False
    assert built["_capture_snapshot"] == {"snapshot_id": "s-1", "version": 3}


def test_trajectories_for_rollout_assembles_through_the_module_seam(tmp_path, monkeypatch):
    import nemo_gym.token_id_capture.consumer as consumer_module
    from nemo_gym.token_id_capture import trajectories_for_rollout
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    store = TokenCaptureStore(tmp_path)
    for entry in _three_turns():
        store.append(entry)
    seen = []
    original = consumer_module._assemble

    def spy(rollout_id, entries, builder, model):
        seen.append([(e.model_call_id, e.prompt_token_ids) for e in entries])
        return original(rollout_id, entries, builder, model)

    monkeypatch.setattr(consumer_module, "_assemble", spy)
    built = trajectories_for_rollout("t0-r0", [tmp_path])

    # The entries handed to the seam are ordinary records: prompts are lists of ints.
    assert seen == [[(e.model_call_id, e.prompt_token_ids) for e in _three_turns()]]
    assert all(type(prompt) is list for _, prompt in seen[0])
    assert built["mask_sample"] is False
    assert built["rebuilt_response"]["output"][-1]["prompt_token_ids"] == [1, 2, 3, 10, 11, 4, 5, 12, 6]


@pytest.mark.parametrize("through", ["directory", "source"])
def test_a_build_runs_the_builder_once_through_run_builder(tmp_path, monkeypatch, through):
    import nemo_gym.token_id_capture.consumer as consumer_module
    from nemo_gym.token_id_capture import trajectories_for_rollout, trajectories_from_source
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    calls = []
    real = consumer_module.run_builder

    def counting(entries, builder="prefix_merging"):
        calls.append(builder)
        return real(entries, builder)

    monkeypatch.setattr(consumer_module, "run_builder", counting)
    if through == "directory":
        store = TokenCaptureStore(tmp_path)
        for entry in _three_turns():
            store.append(entry)
        built = trajectories_for_rollout("t0-r0", [tmp_path])
    else:
        built = asyncio.run(trajectories_from_source("t0-r0", _Source(_three_turns())))

    assert calls == ["prefix_merging"]
    assert built["metrics"]["n_calls"] == 3 and built["metrics"]["chains"] == 1


def test_the_seams_give_the_same_builds_as_the_bulk_row_path(tmp_path):
    from nemo_gym.token_id_capture import trajectories_for_rollout, trajectories_from_source
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    from raycap.capture.consumer import build_local

    for directory in (tmp_path / "a", tmp_path / "b", tmp_path / "c"):
        store = TokenCaptureStore(directory)
        for entry in [*_three_turns(), _entry("side", [90], [91], created_at=9.0)]:
            store.append(entry)

    def without_snapshot(build):
        return {k: v for k, v in build.items() if k != "_capture_snapshot"}

    seam = trajectories_for_rollout("t0-r0", [tmp_path / "a"])
    source = asyncio.run(trajectories_from_source("t0-r0", TokenCaptureStore(tmp_path / "b")))
    bulk = build_local("t0-r0", tmp_path / "c").to_build()

    assert seam["mask_sample"] is True and seam["metrics"]["chains"] == 2
    assert without_snapshot(seam) == without_snapshot(source) == without_snapshot(bulk)


# -- every module of NeMo Gym's package, name for name -------------------------------------------

GYM_NAMES = {
    "records": (
        "TokenEntry", "TOKEN_FIELDS", "TOKEN_ENTRY_RECORD_SCHEMA_VERSION", "extract_token_fields",
        "response_to_output_items", "strip_token_fields",
    ),
    "store": ("TokenCaptureStore", "make_token_store"),
    "builder": (
        "BuildNotes", "BuildOutput", "Chain", "ChainLink", "per_request", "prefix_merging", "run_builder",
        "project_chain_to_output_items", "project_main_chain_response", "assert_prefix_contiguity",
    ),
    "consumer": (
        "trajectories_for_rollout", "trajectories_from_source", "clear_token_captures_for_rollouts",
        "token_id_capture_dirs_from_config", "ROLLOUT_ID_PATTERN", "maybe_rollout_id_from_run_body",
    ),
    "protocols": (
        "TokenSource", "TokenSink", "TokenCaptureSnapshot", "install_token_sink", "installed_token_sink",
        "install_token_source", "installed_token_source",
    ),
    "config": (
        "TOKEN_ID_CAPTURE_BLOCK", "TokenIdCaptureSettings", "TokenIdCaptureConfig", "token_id_capture_config",
        "token_id_capture_enabled_for_agent",
    ),
    "sink": (
        "CaptureContext", "set_token_sink", "reset_token_sink", "current_capture_context", "register_call_intent",
        "capture_tokens", "commit_entry",
    ),
    "delivery": (
        "TOKEN_CAPTURE_KEY", "MASK_SAMPLE_KEY", "rollout_carries_token_ids", "finalize_rollout_token_capture",
        "capture_build_can_retire", "retire_rollout_token_capture", "ROLLOUT_ID_PATTERN",
        "maybe_rollout_id_from_run_body",
    ),
}


@pytest.mark.parametrize("module", sorted(GYM_NAMES))
def test_each_gym_module_holds_its_names_and_the_package_holds_the_same_objects(module):
    package = importlib.import_module("nemo_gym.token_id_capture")
    submodule = importlib.import_module(f"nemo_gym.token_id_capture.{module}")
    assert module in SUBMODULES
    for name in GYM_NAMES[module]:
        assert getattr(submodule, name) is getattr(package, name), (module, name)
        if not name.startswith("_"):
            assert name in package.__all__, name


FORMER_NAMES = {name: name for name in ("records", "store", "builder", "consumer", "protocols", "config", "sink", "delivery")}
FORMER_NAMES["builders"] = "builder"


@pytest.mark.parametrize("former", sorted(FORMER_NAMES))
def test_each_former_top_level_name_is_the_capture_module_itself(former):
    """`raycap.<gym name>` has no file of its own: it is the module `raycap.capture.<name>`,
    whichever import form names it."""
    import raycap

    current = importlib.import_module(f"raycap.capture.{FORMER_NAMES[former]}")
    assert importlib.import_module(f"raycap.{former}") is current
    assert getattr(raycap, former) is current
    namespace: dict = {}
    exec(f"import raycap.{former} as alias\nfrom raycap.{former} import __name__ as named", namespace)
    assert namespace["alias"] is current and namespace["named"] == f"raycap.capture.{FORMER_NAMES[former]}"
    assert not (Path(raycap.__file__).parent / f"{former}.py").exists()


def test_the_records_of_the_former_names_import_as_documented():
    from raycap.records import TokenEntry
    from raycap.store import TokenCaptureStore

    import raycap.capture.records
    import raycap.capture.store

    assert TokenEntry is raycap.capture.records.TokenEntry and TokenCaptureStore is raycap.capture.store.TokenCaptureStore


def test_the_builder_module_has_one_implementation_under_both_names():
    import raycap.builders

    import raycap.capture.builder

    assert raycap.builders is raycap.capture.builder
    assert raycap.capture.builder.Chain.__module__ == "raycap.capture.builder"


SIGNATURES = {
    ("records", "extract_token_fields"): ["response_json"],
    ("records", "response_to_output_items"): ["payload"],
    ("records", "strip_token_fields"): ["items"],
    ("builder", "run_builder"): ["entries", "builder='prefix_merging'"],
    ("builder", "project_main_chain_response"): ["rollout_id", "out", "model=''"],
    ("store", "make_token_store"): ["global_config_dict"],
    ("config", "token_id_capture_config"): ["global_config_dict"],
    ("config", "token_id_capture_enabled_for_agent"): ["global_config_dict", "agent_name"],
    ("consumer", "maybe_rollout_id_from_run_body"): ["body"],
    ("sink", "set_token_sink"): ["context"],
    ("sink", "reset_token_sink"): ["token"],
    ("sink", "register_call_intent"): [],
    ("sink", "capture_tokens"): ["response"],
    ("sink", "commit_entry"): ["entry"],
    ("delivery", "rollout_carries_token_ids"): ["result"],
    ("delivery", "finalize_rollout_token_capture"): ["result", "source"],
    ("delivery", "capture_build_can_retire"): ["built"],
    ("delivery", "retire_rollout_token_capture"): ["rollout_id", "source", "built"],
}


@pytest.mark.parametrize(("module", "name"), sorted(SIGNATURES))
def test_gym_functions_take_gyms_parameter_names(module, name):
    import inspect

    function = getattr(importlib.import_module(f"nemo_gym.token_id_capture.{module}"), name)
    parameters = inspect.signature(function).parameters.values()
    shown = [p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in parameters]
    assert shown[: len(SIGNATURES[module, name])] == SIGNATURES[module, name]
    assert all("=" in extra or extra.startswith("*") for extra in shown[len(SIGNATURES[module, name]) :])


@pytest.mark.slow
def test_gyms_modules_import_neither_ray_nor_a_web_framework_nor_gym():
    modules = ", ".join(f"raycap.{name}" for name in SUBMODULES)
    code = (
        f"import sys, raycap, {modules}\n"
        "banned = ('ray', 'fastapi', 'starlette', 'uvicorn', 'aiohttp', 'flask', 'nemo_gym')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- records, builder and store: the remaining names ---------------------------------------------


def test_response_to_output_items_takes_a_responses_output_or_chat_messages():
    from nemo_gym.token_id_capture.records import response_to_output_items

    reasoning, message = {"type": "reasoning", "summary": []}, {"type": "message", "content": "hi"}
    assert response_to_output_items({"output": [reasoning, "junk", message]}) == [reasoning, message]
    chat = {
        "output": [],
        "choices": [
            {"message": {"content": "a", "generation_token_ids": [1]}},
            {"message": {"role": "tool", "type": "function_call", "content": "b"}},
            {"message": "not a dict"},
            "not a choice",
        ],
    }
    items = response_to_output_items(chat)
    assert items == [
        {"content": "a", "generation_token_ids": [1], "type": "message", "role": "assistant"},
        {"role": "tool", "type": "function_call", "content": "b"},
    ]
    assert chat["choices"][0]["message"] == {"content": "a", "generation_token_ids": [1]}  # copied, not changed
    assert response_to_output_items({"id": "x"}) == []


def test_strip_token_fields_copies_the_items_without_the_arrays_and_finds_the_carrier():
    from nemo_gym.token_id_capture.records import TOKEN_FIELDS, strip_token_fields

    carrier = {"type": "message", "content": "a", "prompt_token_ids": [1], "generation_token_ids": [2],
               "generation_log_probs": [-0.5], "routed_experts": [[0]]}
    stale = {"type": "reasoning", "generation_token_ids": None, "prompt_token_ids": [9]}
    items, index = strip_token_fields([stale, carrier])
    assert (items, index) == ([{"type": "reasoning"}, {"type": "message", "content": "a"}], 1)
    assert set(TOKEN_FIELDS) <= set(carrier)  # the caller's items are not changed
    assert strip_token_fields([{"type": "message"}]) == ([{"type": "message"}], None)
    with pytest.raises(ValueError, match="multiple output items carry token metadata"):
        strip_token_fields([carrier, dict(carrier)])


def test_extract_token_fields_takes_response_json_and_refuses_multiple_response_items():
    from nemo_gym.token_id_capture.records import extract_token_fields

    item = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]}
    fields = extract_token_fields(response_json={"output": [item]})
    assert fields == {**item, "routed_experts": None}
    with pytest.raises(ValueError, match="multiple response items"):
        extract_token_fields(response_json={"choices": [{"message": item}, {"message": dict(item)}]})


def test_a_newer_record_schema_is_refused_saying_what_this_reader_understands():
    from nemo_gym.token_id_capture.records import TokenEntry
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="this reader understands up to 1"):
        TokenEntry(**{**_entry("c1", [1], [2]).model_dump(), "schema_version": 2})


def test_chain_validate_names_the_first_link_whose_log_probs_do_not_pair_with_its_tokens():
    from nemo_gym.token_id_capture.builder import Chain, ChainLink
    from nemo_gym.token_id_capture.records import TokenEntry

    good = _entry("c1", [1, 2], [3])
    bad = TokenEntry.model_construct(**{**_entry("c2", [1, 2, 3], [4, 5]).model_dump(), "generation_log_probs": [-1.0]})
    worse = TokenEntry.model_construct(**{**_entry("c3", [1, 2, 3, 4, 5], [6]).model_dump(), "generation_log_probs": []})
    assert Chain("main", [ChainLink(good, [])], [1, 2]).validate() is None
    chain = Chain("main", [ChainLink(good, []), ChainLink(bad, []), ChainLink(worse, [])], [1, 2])
    with pytest.raises(ValueError) as caught:
        chain.validate()
    assert str(caught.value) == "log-prob/token length mismatch on c2: 1 vs 2"


def test_project_main_chain_response_takes_the_builder_output_as_out():
    from nemo_gym.token_id_capture.builder import prefix_merging, project_main_chain_response

    response = project_main_chain_response(rollout_id="t0-r0", out=prefix_merging(_three_turns()), model="m")
    assert (response["id"], response["model"], response["usage"]) == ("proj-t0-r0", "m", {"input_tokens": 3, "output_tokens": 5})


def test_is_incomplete_reads_the_state_flag_under_a_shared_lock(tmp_path):
    import fcntl
    import os

    from nemo_gym.token_id_capture.store import TokenCaptureStore

    store = TokenCaptureStore(tmp_path)
    assert store.is_incomplete("t0-r0") is False  # no state file
    assert not store.path_for("t0-r0").exists()
    store.append(_three_turns()[0])
    store.begin_call_now("t0-r0", "lost")
    assert store.is_incomplete("t0-r0") is False  # a dangling intent is for freeze to judge
    store.mark_incomplete_now("t0-r0", "c9")
    assert store.is_incomplete("t0-r0") is True
    for bad in ("", "../x", "a b"):
        with pytest.raises(ValueError, match="Invalid rollout id: "):
            store.is_incomplete(bad)

    # A writer holding the exclusive lock keeps the read waiting; readers share it.
    fd = os.open(store.lock_path_for("t0-r0"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    answers = []
    reader = threading.Thread(target=lambda: answers.append(store.is_incomplete("t0-r0")))
    reader.start()
    reader.join(0.3)
    assert answers == []
    fcntl.flock(fd, fcntl.LOCK_SH)  # downgraded to shared: the reader gets in
    reader.join(10)
    os.close(fd)
    assert answers == [True]
