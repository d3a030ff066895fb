"""A nats-server started without JetStream (no ``-js``): every service that needs it says so, in
seconds, and names the flag."""

import subprocess
import sys
import time

import pytest
from nats.js.errors import ServiceUnavailableError

from infera.procs import free_port, nats_server_binary, stop_process, wait_port
from infera_common.nats_conn import no_jetstream


@pytest.fixture
def plain_nats():
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_port("127.0.0.1", port, 10.0, proc)
        yield f"nats://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def test_the_jetstream_apis_503_is_recognised():
    assert no_jetstream(ServiceUnavailableError()) and not no_jetstream(TimeoutError())


@pytest.mark.parametrize("service", [["infera_router"], ["infera_kv_indexer"],
                                     ["infera_worker_agent", "--engine", "mock"]])
def test_a_service_on_a_server_without_jetstream_says_start_it_with_js(plain_nats, subprocess_env, service):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", *service, "--nats-url", plain_nats, "--metrics-port", "0"],
                       env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "JetStream is unavailable on the NATS server" in r.stderr, r.stderr
    assert "start nats-server with -js" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 20
