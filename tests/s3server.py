"""A real S3 API for the tests: moto's server mode on 127.0.0.1, reached over HTTP.

`make test` runs the whole suite inside one server:

    python tests/s3server.py run -- python -m pytest ...

starts `moto_server` on a free port, exports its endpoint (`AWS_ENDPOINT_URL`, and
`RAYCAP_TEST_S3_ENDPOINT` so the tests know it is theirs) with dummy credentials, runs the
command and stops the server when it ends, however it ends; the exit status is the
command's. Run without it (a single test file), the `s3` fixture of tests/conftest.py
starts a server of its own with `start`. Nothing here calls an in-process mock: every
request the tests make goes over HTTP to the server, as it would to S3.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ENDPOINT_VARIABLE = "RAYCAP_TEST_S3_ENDPOINT"
# What boto3 and pyarrow need besides the endpoint: any credentials do for moto, and the
# instance metadata service is never asked (it is not on this machine).
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "raycap-test",
    "AWS_SECRET_ACCESS_KEY": "raycap-test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server_command() -> list[str]:
    beside = Path(sys.executable).with_name("moto_server")
    return [str(beside) if beside.exists() else (shutil.which("moto_server") or "moto_server")]


def start() -> tuple[subprocess.Popen, str]:
    """A moto server on a free port of 127.0.0.1, answering when this returns: (process, endpoint)."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [*_server_command(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(endpoint + "/", timeout=2):
                return process, endpoint
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop(process)
                raise RuntimeError(f"the S3 test server (moto_server) did not start on {endpoint}") from None
            time.sleep(0.1)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def environment(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, ENDPOINT_VARIABLE: endpoint, **CREDENTIALS}


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "run" or argv[1] != "--":
        print("usage: python tests/s3server.py run -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    process, endpoint = start()
    try:
        return subprocess.call(argv[2:], env={**os.environ, **environment(endpoint)})
    finally:
        stop(process)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
