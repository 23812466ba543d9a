"""A quiet console on raycap's own paths: Ray's notices that say nothing about the work.

raycap's console carries the work's own lines, its summary and raycap's warnings (real
faults). Three notices of Ray's would drown them, so raycap turns each off, with the
narrowest switch that leaves Ray's behaviour as it was, and only on its own paths:

- "Token authentication is enabled for this Ray cluster": Ray logs it when it starts a
  local instance with RAY_AUTH_MODE unset, and enables token authentication, which is
  what raycap's embedded instance wants. Setting RAY_AUTH_MODE=token after Ray is
  imported does not reach the driver's cached config, and RAY_AUTH_MODE=disabled would
  weaken security, so raycap drops exactly that record from Ray's authentication logger
  while `connect` starts the embedded instance (`quiet_embedded_start`); authentication
  is unchanged. When joining a cluster raycap changes nothing: set RAY_AUTH_MODE=token
  (or disabled, to match the cluster) in the environment before Python starts, and Ray
  does not announce the mode it was told.
- Ray Data's INFO lines (execution plans, progress logged line by line when stdout is
  not a terminal) and its progress bars: `raycap.dataset` sets the driver's
  `DataContext.enable_progress_bars = False` and the level of the `ray.data` logger's
  console handler to WARNING, so Ray Data's warnings still show (and its log file in the
  Ray session directory keeps everything). The one notice Ray Data logs about the
  bars being off is not shown either (its progress module's logger is set to ERROR).
- "tqdm is not installed. Progress bars will be disabled." (and Ray Data's "pip install
  tqdm" hint): both come from progress bars, which are then never created.

Set RAYCAP_QUIET_RAY=0 to leave all of Ray's console as Ray configures it.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Iterator

QUIET_ENV = "RAYCAP_QUIET_RAY"
# Where Ray logs the notice (ray/_private/authentication/authentication_token_setup.py).
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


def _enabled() -> bool:
    return os.environ.get(QUIET_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class _DropAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_AUTH_NOTICE)


@contextmanager
def quiet_embedded_start() -> Iterator[None]:
    """Around the `ray.init` that starts a local instance: without Ray's notice that token
    authentication is on (the only record dropped; its other warnings still show)."""
    if not _enabled():
        yield
        return
    auth_logger = logging.getLogger(_AUTH_LOGGER)
    notice = _DropAuthNotice()
    auth_logger.addFilter(notice)
    try:
        yield
    finally:
        auth_logger.removeFilter(notice)


def quiet_ray_data() -> None:
    """Before a Ray Data execution in this process: no progress bars, no INFO lines."""
    if not _enabled():
        return
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    # Only the console handlers: Ray Data's log file in the session directory keeps
    # everything, for whoever debugs an execution.
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.level < logging.WARNING:
            handler.setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
