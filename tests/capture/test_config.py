"""raycap.capture.config, as NeMo Gym's `token_id_capture.config` (SPEC 10.1), and the store a
config names (`make_token_store`, SPEC 10.3). No Ray here.

Sink classes for `build_sink` are defined in this module, which is importable by name
(`test_config:GoodSink`), as a model server's sink module would be.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
from pydantic import ValidationError

from gym_alias import nemo_gym_alias  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("nemo_gym_alias")


class GoodSink:
    """A TokenSink that a config constructs from its sink_kwargs."""

    def __init__(self, path: str, *, retries: int = 0) -> None:
        self.path, self.retries = path, retries

    async def put(self, entry) -> None: ...

    async def mark_incomplete(self, rollout_id, model_call_id="") -> None: ...

    async def close(self) -> None: ...


class HalfSink:
    """Has put only."""

    def __init__(self) -> None:
        self.close = "not callable"

    async def put(self, entry) -> None: ...


def _config(block: dict | None = None, **top):
    from nemo_gym.token_id_capture.config import TokenIdCaptureConfig

    return TokenIdCaptureConfig.model_validate({"token_id_capture": block or {}, **top})


@pytest.fixture
def no_installed_sink():
    from nemo_gym.token_id_capture.protocols import install_token_sink, installed_token_sink

    previous = installed_token_sink()
    install_token_sink(None)
    yield
    install_token_sink(previous)


# -- the shape ----------------------------------------------------------------------------------


def test_the_block_name_and_the_defaults():
    from nemo_gym.token_id_capture.config import TOKEN_ID_CAPTURE_BLOCK, TokenIdCaptureConfig, TokenIdCaptureSettings

    assert TOKEN_ID_CAPTURE_BLOCK == "token_id_capture"
    settings = TokenIdCaptureSettings()
    assert settings.model_dump() == {
        "enabled": False, "all_agents": False, "dir": None, "sink": None, "sink_kwargs": {},
        "rebuild_response": True, "max_mask_fraction": None, "mask_fraction_min_samples": 50,
    }
    config = TokenIdCaptureConfig()
    assert config.token_id_capture == settings and config.model_call_capture_dir is None
    assert config.enabled is False and config.resolved_dir() is None and config.build_sink() is None


def test_the_block_refuses_unknown_keys_and_the_whole_config_ignores_other_top_level_keys(tmp_path):
    from nemo_gym.token_id_capture.config import TokenIdCaptureSettings

    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TokenIdCaptureSettings(enabled=True, source="my.module:Source")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        _config({"enabled": True, "dir": str(tmp_path), "source": "x"})
    config = _config({"enabled": True}, model_call_capture_dir=str(tmp_path), policy={"lr": 1e-6}, agents=[1, 2])
    assert config.enabled and config.resolved_dir() == tmp_path


def test_resolved_dir_is_the_blocks_dir_else_model_call_capture_dir(tmp_path):
    own = tmp_path / "own"
    assert _config({"enabled": True, "dir": str(own)}, model_call_capture_dir=str(tmp_path)).resolved_dir() == own
    fallback = _config({"enabled": True}, model_call_capture_dir=str(tmp_path)).resolved_dir()
    assert fallback == tmp_path and isinstance(fallback, Path)


# -- validation, step by step -----------------------------------------------------------------------


def test_1_a_disabled_block_is_not_checked(no_installed_sink):
    assert _config({"dir": "relative"}).enabled is False
    assert _config({}, model_call_capture_dir="also/relative").resolved_dir() == Path("also/relative")


def test_2_a_sink_is_accepted_without_importing_it_and_a_dir_beside_it_is_named_in_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        _config({"enabled": True, "sink": "no_such_sink_module:Sink", "dir": str(tmp_path)})
    assert "no_such_sink_module" not in sys.modules
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "will not be written to" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path) in warned[0].getMessage()

    # The run-wide model_call_capture_dir is not the block's dir: no warning for it.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _config({"enabled": True, "sink": "no_such_sink_module:Sink"}, model_call_capture_dir=str(tmp_path))
    assert caplog.records == []
    # A relative dir beside a sink is not checked: the sink takes the records.
    with caplog.at_level(logging.WARNING):
        _config({"enabled": True, "sink": "x:Y", "dir": "relative"})
    assert ["relative" in r.getMessage() and "will not be written to" in r.getMessage() for r in caplog.records] == [True]


def test_3_without_a_directory_a_sink_must_be_installed_or_responses_not_rebuilt(no_installed_sink, tmp_path):
    from nemo_gym.token_id_capture.protocols import install_token_sink
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    with pytest.raises(ValidationError, match="token_id_capture requires a directory or sink"):
        _config({"enabled": True})
    assert _config({"enabled": True, "rebuild_response": False}).resolved_dir() is None
    install_token_sink(TokenCaptureStore(tmp_path))
    assert _config({"enabled": True}).enabled


def test_4_the_directory_must_be_absolute(no_installed_sink):
    for config in ({"token_id_capture": {"enabled": True, "dir": "caps"}},
                   {"token_id_capture": {"enabled": True}, "model_call_capture_dir": "./caps"}):
        with pytest.raises(ValidationError, match="training-token capture directory must be an absolute path") as caught:
            _config(config["token_id_capture"], **{k: v for k, v in config.items() if k != "token_id_capture"})
        assert "'caps'" in str(caught.value)


def test_an_installed_sink_does_not_excuse_a_relative_directory(no_installed_sink, tmp_path):
    from nemo_gym.token_id_capture.protocols import install_token_sink
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    install_token_sink(TokenCaptureStore(tmp_path))
    with pytest.raises(ValidationError, match="must be an absolute path"):
        _config({"enabled": True, "dir": "caps"})


def test_token_id_capture_config_reads_a_global_config_of_any_mapping(tmp_path):
    from nemo_gym.token_id_capture.config import TokenIdCaptureConfig, token_id_capture_config

    assert token_id_capture_config(None) == TokenIdCaptureConfig()
    assert token_id_capture_config({}) == TokenIdCaptureConfig()
    read_only = MappingProxyType({"token_id_capture": MappingProxyType({"enabled": True, "dir": str(tmp_path)}),
                                  "other": object()})
    assert token_id_capture_config(read_only).resolved_dir() == tmp_path
    with pytest.raises(ValidationError, match="token_id_capture requires a directory or sink"):
        token_id_capture_config({"token_id_capture": {"enabled": True}})


# -- build_sink ---------------------------------------------------------------------------------


def test_build_sink_is_none_when_disabled_or_without_a_sink(tmp_path):
    assert _config({"sink": "test_config:GoodSink", "sink_kwargs": {"path": "p"}}).build_sink() is None
    assert _config({"enabled": True, "dir": str(tmp_path)}).build_sink() is None


def test_build_sink_constructs_the_class_with_its_kwargs_in_this_process():
    from nemo_gym.token_id_capture.protocols import TokenSink

    sink = _config({"enabled": True, "sink": "test_config:GoodSink", "sink_kwargs": {"path": "/p", "retries": 2}}).build_sink()
    assert type(sink).__name__ == "GoodSink" and (sink.path, sink.retries) == ("/p", 2)
    assert isinstance(sink, TokenSink)


def test_the_local_store_is_a_configurable_sink(tmp_path):
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    sink = _config({"enabled": True, "sink": "raycap.capture.store:TokenCaptureStore", "sink_kwargs": {"root": str(tmp_path)}}).build_sink()
    assert isinstance(sink, TokenCaptureStore) and sink.root == tmp_path


@pytest.mark.parametrize(
    ("sink", "kwargs", "message"),
    [
        ("test_config.GoodSink", {}, "token_id_capture.sink must be 'module.path:ClassName' (got 'test_config.GoodSink')"),
        ("no_such_sink_module:Sink", {}, "could not load token_id_capture.sink 'no_such_sink_module:Sink': No module named"),
        ("test_config:Missing", {}, "could not load token_id_capture.sink 'test_config:Missing': module 'test_config' has no attribute"),
        ("test_config:GoodSink", {"retries": 1, "colour": "red"},
         "could not construct token_id_capture.sink 'test_config:GoodSink' with sink_kwargs=['colour', 'retries']: "),
        ("test_config:HalfSink", {}, "token_id_capture.sink 'test_config:HalfSink' does not satisfy TokenSink: close, mark_incomplete"),
    ],
)
def test_build_sink_errors_name_the_target_and_what_went_wrong(sink, kwargs, message):
    config = _config({"enabled": True, "sink": sink, "sink_kwargs": kwargs})
    with pytest.raises(ValueError) as caught:
        config.build_sink()
    assert type(caught.value) is ValueError
    assert str(caught.value).startswith(message)


def test_build_sink_says_the_attribute_check_failed_when_only_the_protocol_check_does(monkeypatch):
    from typing import Protocol, runtime_checkable

    import nemo_gym.token_id_capture.config as config_module

    @runtime_checkable
    class StricterSink(Protocol):
        async def put(self, entry) -> None: ...

        async def mark_incomplete(self, rollout_id, model_call_id="") -> None: ...

        async def close(self) -> None: ...

        async def flush(self) -> None: ...

    monkeypatch.setattr(config_module, "TokenSink", StricterSink)
    config = _config({"enabled": True, "sink": "test_config:GoodSink", "sink_kwargs": {"path": "p"}})
    with pytest.raises(ValueError, match="does not satisfy TokenSink: attribute check failed$"):
        config.build_sink()


# -- which agents capture ------------------------------------------------------------------------


def _agents(enabled=True, all_agents=False, **agents):
    return {"token_id_capture": {"enabled": enabled, "all_agents": all_agents, "rebuild_response": False}, **agents}


def test_token_id_capture_enabled_for_agent():
    from nemo_gym.token_id_capture.config import token_id_capture_enabled_for_agent as enabled_for

    on = {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py", "token_id_capture": True}}}
    off = {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py", "token_id_capture": False}}}
    config = _agents(math=on, chat=off, odd={"responses_api_agents": ["not", "a", "mapping"]}, flat="x")
    assert enabled_for(config, "math") is True
    assert enabled_for(config, "chat") is False
    assert enabled_for(config, "odd") is False
    assert enabled_for(config, "flat") is False
    assert enabled_for(config, "absent") is False
    assert enabled_for(config, "") is False and enabled_for(config, None) is False
    assert enabled_for(_agents(enabled=False, math=on), "math") is False
    assert enabled_for(_agents(all_agents=True), "anyone") is True
    assert enabled_for(_agents(all_agents=True), "") is True
    assert enabled_for(MappingProxyType(_agents(math=MappingProxyType(on))), "math") is True


# -- make_token_store ------------------------------------------------------------------------------


def test_make_token_store_opens_the_configured_directory_only(tmp_path, no_installed_sink):
    from nemo_gym.token_id_capture.store import TokenCaptureStore, make_token_store

    store = make_token_store({"token_id_capture": {"enabled": True, "dir": str(tmp_path / "caps")}})
    assert isinstance(store, TokenCaptureStore) and store.root == tmp_path / "caps"
    fallback = make_token_store({"token_id_capture": {"enabled": True}, "model_call_capture_dir": str(tmp_path)})
    assert fallback.root == tmp_path
    assert make_token_store({"token_id_capture": {"dir": str(tmp_path)}}) is None  # disabled
    assert make_token_store({"token_id_capture": {"enabled": True, "sink": "x:Y", "dir": str(tmp_path)}}) is None
    assert make_token_store({"token_id_capture": {"enabled": True, "rebuild_response": False}}) is None
    assert make_token_store({}) is None and make_token_store(None) is None
    with pytest.raises(ValidationError, match="must be an absolute path"):
        make_token_store({"token_id_capture": {"enabled": True, "dir": "relative"}})
