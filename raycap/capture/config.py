"""The `token_id_capture` configuration of a run, as NeMo Gym reads it.

A run's global config holds a `token_id_capture` block (`TokenIdCaptureSettings`) and,
at the top level, `model_call_capture_dir`, its fallback. `TokenIdCaptureConfig` reads
both and ignores every other key; the block refuses unknown keys.

Validation runs once, when the config is read:

1. a disabled block is accepted as it is;
2. a block naming a `sink` ("module.path:ClassName") is accepted without importing it;
3. without a directory (`resolved_dir()`), only when a sink is installed here or
   responses are not rebuilt;
4. the directory must be absolute.

`build_sink()` imports and constructs the configured sink and checks it is a
`TokenSink`. The long form: docs/internals.md ("The capture config"). This module
imports neither Ray nor any server stack.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raycap.capture.protocols import TokenSink, installed_token_sink

logger = logging.getLogger(__name__)

TOKEN_ID_CAPTURE_BLOCK = "token_id_capture"
_SINK_MEMBERS = ("close", "mark_incomplete", "put")


class TokenIdCaptureSettings(BaseModel):
    """The `token_id_capture` block of a run's config. Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    all_agents: bool = False
    dir: Path | None = None
    sink: str | None = None
    sink_kwargs: dict[str, Any] = {}
    rebuild_response: bool = True
    max_mask_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    mask_fraction_min_samples: int = Field(default=50, ge=0)


class TokenIdCaptureConfig(BaseModel):
    """The capture side of a run's whole config: the block and `model_call_capture_dir`.

    Other top-level keys belong to the rest of the run and are ignored."""

    model_config = ConfigDict(extra="ignore")

    token_id_capture: TokenIdCaptureSettings = Field(default_factory=TokenIdCaptureSettings)
    model_call_capture_dir: Path | None = None

    @model_validator(mode="after")
    def _check(self) -> TokenIdCaptureConfig:
        block = self.token_id_capture
        if not block.enabled:
            return self
        if block.sink is not None:
            if block.dir is not None:
                logger.warning(
                    "token_id_capture.sink %r is configured, so token_id_capture.dir %s will not be written to; "
                    "remove the dir, or the sink to write there",
                    block.sink,
                    block.dir,
                )
            return self
        directory = self.resolved_dir()
        if directory is None:
            if installed_token_sink() is not None or not block.rebuild_response:
                return self
            raise ValueError(
                "token_id_capture requires a directory or sink: set token_id_capture.dir (or "
                "model_call_capture_dir) to an absolute path, configure token_id_capture.sink, or set "
                "rebuild_response: false"
            )
        if not directory.is_absolute():
            raise ValueError(
                f"training-token capture directory must be an absolute path (got {str(directory)!r}): every "
                "model server and the consumer must resolve it to the same directory"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.token_id_capture.enabled

    def resolved_dir(self) -> Path | None:
        """The block's `dir`, else `model_call_capture_dir`, else None."""
        if self.token_id_capture.dir is not None:
            return self.token_id_capture.dir
        return self.model_call_capture_dir

    def build_sink(self) -> TokenSink | None:
        """The configured sink, constructed here from `sink_kwargs`; None when capture
        is disabled or no sink is configured."""
        block = self.token_id_capture
        if not block.enabled or block.sink is None:
            return None
        target = block.sink
        if ":" not in target:
            raise ValueError(f"token_id_capture.sink must be 'module.path:ClassName' (got {target!r})")
        module_name, _, attribute = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"could not load token_id_capture.sink {target!r}: {err}") from err
        try:
            sink = cls(**block.sink_kwargs)
        except TypeError as err:
            raise ValueError(
                f"could not construct token_id_capture.sink {target!r} with "
                f"sink_kwargs={sorted(block.sink_kwargs)}: {err}"
            ) from err
        missing = sorted(name for name in _SINK_MEMBERS if not callable(getattr(sink, name, None)))
        if missing or not isinstance(sink, TokenSink):
            raise ValueError(
                f"token_id_capture.sink {target!r} does not satisfy TokenSink: "
                f"{', '.join(missing) or 'attribute check failed'}"
            )
        return sink


def _plain(value: Any) -> Any:
    # Read-only and framework mappings (OmegaConf's, say) become dicts for pydantic.
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def token_id_capture_config(global_config_dict: Any) -> TokenIdCaptureConfig:
    """Validate the capture side of a run's global config (None reads as {})."""
    config = global_config_dict if global_config_dict is not None else {}
    if not isinstance(config, Mapping):
        return TokenIdCaptureConfig.model_validate(config)  # pydantic's error names the type
    # Only the two keys this config reads are copied: the rest of a run's config is
    # another component's, and may not even resolve here.
    keys = (TOKEN_ID_CAPTURE_BLOCK, "model_call_capture_dir")
    return TokenIdCaptureConfig.model_validate({key: _plain(config[key]) for key in keys if config.get(key) is not None})


def token_id_capture_enabled_for_agent(global_config_dict: Any, agent_name: str | None) -> bool:
    """Whether the rollouts of `agent_name` are captured: capture is enabled and either
    every agent is (`all_agents`), or the agent's config
    (`config[agent_name]["responses_api_agents"]`) has an entry with a truthy
    `token_id_capture`."""
    config = token_id_capture_config(global_config_dict)
    if not config.enabled:
        return False
    if config.token_id_capture.all_agents:
        return True
    if not agent_name or not isinstance(global_config_dict, Mapping):
        return False
    agent = global_config_dict.get(agent_name)
    agents = agent.get("responses_api_agents") if isinstance(agent, Mapping) else None
    if not isinstance(agents, Mapping):
        return False
    return any(isinstance(entry, Mapping) and bool(entry.get("token_id_capture")) for entry in agents.values())
