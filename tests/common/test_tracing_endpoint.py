"""A mistyped --otlp-traces-endpoint: nothing answers there, and the service says so at start (spans
were dropped without a word, and each service's exit waited on the SDK's export retries)."""

from __future__ import annotations

import socket
import subprocess
import sys

from infera.procs import free_port
from infera_common.tracing import unreachable


def test_an_endpoint_nothing_listens_on_is_unreachable_and_a_listening_one_is_not():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert unreachable(f"http://127.0.0.1:{listening.getsockname()[1]}/v1/traces") is None
    assert unreachable(f"http://127.0.0.1:{free_port()}/v1/traces")
    assert unreachable("http://no-such-host.invalid:4318/v1/traces")


def test_a_service_started_with_an_unreachable_collector_warns_naming_the_flag(nats_server, subprocess_env):
    endpoint = f"http://127.0.0.1:{free_port()}/v1/traces"
    with socket.socket() as taken:  # the frontend then stops at once, once it has said what it says at start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = subprocess.run(
            [sys.executable, "-m", "infera_frontend", "--nats-url", nats_server,
             "--otlp-traces-endpoint", endpoint, "--port", str(taken.getsockname()[1])],
            capture_output=True, text=True, timeout=60, env={**subprocess_env, "INFERA_LOG_FORMAT": "json"},
        )
    logs = out.stdout + out.stderr
    assert "otlp_collector_unreachable" in logs and endpoint in logs and "--otlp-traces-endpoint" in logs, logs
