"""`nemo_gym.token_id_capture` as raycap, the way a team that swaps raycap in imports it.

The fixture maps NeMo Gym's package and each of its submodules onto raycap's module of
the same name, for the duration of one test; tests then use only NeMo Gym's names.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest

import raycap

# NeMo Gym's submodules; raycap has a module of each name.
SUBMODULES = ("records", "store", "builder", "consumer", "protocols", "config", "sink", "delivery")


@pytest.fixture
def nemo_gym_alias(monkeypatch):
    package = types.ModuleType("nemo_gym")
    package.token_id_capture = raycap
    monkeypatch.setitem(sys.modules, "nemo_gym", package)
    monkeypatch.setitem(sys.modules, "nemo_gym.token_id_capture", raycap)
    for name in SUBMODULES:
        monkeypatch.setitem(sys.modules, f"nemo_gym.token_id_capture.{name}", importlib.import_module(f"raycap.{name}"))
