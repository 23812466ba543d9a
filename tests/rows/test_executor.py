"""The one executor decision, the options value and the front door's checks (no Ray).

`raycap.rows.executor.decide` is a function of the request and of what is known of Ray, so
each branch is checked here by describing the request and the Ray state; the sessions
and the jobs only ever ask it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import raycap
from raycap.capture.directory import CaptureDir, capture_dirs
from raycap.rows import executor as executor_module
from raycap.rows.executor import ExecutorChoice, RayState, Request, decide
from raycap.rows.options import RebuildOptions, checked_rollout_ids

NOT_RUNNING = RayState(running=False)
COLD = RayState(running=True, alive_nodes=1)  # running, this driver's workers not up yet


@pytest.fixture
def captures(corpus_copy):
    return corpus_copy("captures")


def _request(directory: str, kind: str = "rows", address: str | None = None, **options) -> Request:
    return Request(capture_dirs([directory]), None, RebuildOptions(**options), kind, address)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_cluster_in_the_environment(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


# --- each branch of the decision ---------------------------------------------------------


def test_object_refs_always_come_from_ray_even_when_local_is_asked_for(captures):
    choice = decide(_request(captures, "refs", executor="local"), NOT_RUNNING)
    assert choice == ExecutorChoice("ray", "object refs were asked for")


def test_an_executor_asked_for_is_obeyed(captures):
    assert decide(_request(captures, executor="ray"), NOT_RUNNING).executor == "ray"
    assert decide(_request(captures, executor="local"), COLD) == ExecutorChoice("local", "executor: local was asked for")


def test_executor_local_refuses_a_directory_on_a_named_node(captures):
    request = Request((CaptureDir(captures, "node-a"),), None, RebuildOptions(executor="local"))
    with pytest.raises(ValueError, match=r"executor local .* names a node; use executor ray"):
        decide(request, NOT_RUNNING)


def test_auto_without_ray_builds_a_small_input_here(captures):
    choice = decide(_request(captures), NOT_RUNNING)
    assert choice.executor == "local" and not choice.cold and "MB of captures build in this process" in choice.reason


def test_auto_without_ray_sends_a_large_input_to_ray(captures, monkeypatch):
    monkeypatch.setattr(executor_module, "LOCAL_MAX_BYTES", 10)
    assert decide(_request(captures), NOT_RUNNING).executor == "ray"


def test_auto_without_ray_goes_to_a_cluster_that_is_asked_for(captures, monkeypatch):
    assert decide(_request(captures, address="10.0.0.1:6379"), NOT_RUNNING).executor == "ray"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert decide(_request(captures), NOT_RUNNING).executor == "ray"


def test_auto_without_ray_refuses_a_plain_path_missing_here(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist on this machine"):
        decide(_request(str(tmp_path / "absent")), NOT_RUNNING)


def test_auto_without_ray_sends_a_directory_on_a_named_node_to_ray(captures):
    request = Request((CaptureDir(captures, "node-a"),), None, RebuildOptions())
    choice = decide(request, NOT_RUNNING)
    assert choice.executor == "ray" and "names a node" in choice.reason


def test_a_warm_driver_builds_on_ray(captures):
    choice = decide(_request(captures), RayState(running=True, warm=True))
    assert choice == ExecutorChoice("ray", "Ray is running and this driver's workers are up")


def test_a_dataset_or_a_cluster_by_address_is_built_by_ray_tasks_even_on_a_first_call(captures):
    for request in (_request(captures, "shards"), _request(captures, address="10.0.0.1:6379")):
        choice = decide(request, COLD)
        assert choice.executor == "ray" and not choice.cold and "builder tasks write the rows" in choice.reason


def test_a_first_call_on_several_nodes_goes_to_ray(captures):
    choice = decide(_request(captures), RayState(running=True, alive_nodes=3))
    assert choice == ExecutorChoice("ray", "Ray is running with several nodes")


def test_a_large_first_call_goes_to_ray(captures, monkeypatch):
    monkeypatch.setattr(executor_module, "LOCAL_MAX_BYTES", 10)
    choice = decide(_request(captures), COLD)
    assert choice.executor == "ray" and not choice.cold and "Ray's cores pay" in choice.reason


def test_a_small_first_call_on_one_node_is_cold(captures):
    choice = decide(_request(captures), COLD)
    assert choice.executor == "ray" and choice.cold and "first call on this Ray" in choice.reason


def test_retiring_runs_here_unless_ray_runs_or_is_asked_for(captures):
    assert decide(_request(captures, "retire"), NOT_RUNNING).executor == "local"
    assert decide(_request(captures, "retire"), COLD).executor == "ray"
    assert decide(_request(captures, "retire", address="10.0.0.1:6379"), NOT_RUNNING).executor == "ray"


# --- the options value -------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(builder="nope"), "unknown builder 'nope'; known builders: per_request, prefix_merging"),
        (dict(delivery="rows"), "unknown delivery 'rows'; use one of: rollout, chains"),
        (dict(executor="gpu"), "unknown executor 'gpu'; use one of: auto, ray, local"),
        (dict(batch_size=0), "batch_size must be a positive integer"),
        (dict(batch_size=-3), "batch_size must be a positive integer"),
        (dict(max_in_flight=0), "max_in_flight must be a positive integer"),
        (dict(batch_size=True), "batch_size must be a positive integer"),
    ],
)
def test_invalid_options_are_refused_when_the_value_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        RebuildOptions(**options)


def test_options_are_frozen_and_a_changed_copy_is_checked_again():
    options = RebuildOptions(delivery="chains", batch_size=4)
    with pytest.raises(AttributeError):
        options.delivery = "rollout"  # type: ignore[misc]
    assert options.but(delivery=None, model="m") == RebuildOptions(delivery="chains", batch_size=4, model="m")
    with pytest.raises(ValueError, match="unknown delivery"):
        options.but(delivery="rows")


# --- the front door ----------------------------------------------------------------------


@pytest.mark.parametrize("ids", ["rollout-1", b"rollout-1"])
def test_rollout_ids_given_as_one_string_are_refused_before_anything_is_touched(tmp_path, ids):
    # A directory that does not exist: touching it would raise FileNotFoundError instead.
    with pytest.raises(TypeError, match="rollout_ids must be a list of ids"):
        raycap.rebuild([str(tmp_path / "absent")], ids)
    with pytest.raises(TypeError, match="rollout_ids must be a list of ids"):
        checked_rollout_ids(ids)


def test_an_empty_directory_list_is_refused():
    with pytest.raises(ValueError, match="no capture directories given"):
        raycap.rebuild([])


def test_a_single_directory_string_is_refused_as_the_list(captures):
    with pytest.raises(TypeError, match="capture directories must be a list"):
        raycap.rebuild(captures)


def test_directories_with_the_same_real_path_are_one_directory(captures, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(captures)
    assert capture_dirs([captures, str(link), captures + "/"]) == (CaptureDir(captures),)
    once = raycap.rebuild([captures], executor="local")
    assert raycap.rebuild([captures, str(link)], executor="local").equals(once)


def test_bad_options_fail_at_the_front_door_before_any_directory_is_read(tmp_path):
    with pytest.raises(ValueError, match="unknown delivery"):
        raycap.rebuild([str(tmp_path / "absent")], delivery="rows")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        raycap.rebuild([str(tmp_path / "absent")], batch_size=0)


@pytest.mark.slow
def test_a_small_call_in_a_fresh_process_builds_here_without_importing_ray(captures):
    code = (
        "import sys, raycap\n"
        f"table = raycap.rebuild([{captures!r}])\n"
        "print(table.num_rows, 'ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    rows, imported = out.stdout.split()
    assert int(rows) > 0 and imported == "False"
