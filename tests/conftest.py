"""Shared fixtures: a real nats-server with JetStream, and a real etcd, on free 127.0.0.1 ports, per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from infera.procs import free_port, start_etcd, start_nats, stop_process

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
MODEL_DIR = ROOT / "libs" / "infera_common" / "models" / "SmolLM2-135M-Instruct"
PYTHON = sys.executable


@pytest.fixture
def nats_server(tmp_path):
    """URL of a fresh nats-server (JetStream on, state in tmp_path), stopped after the test."""
    port = free_port()
    proc = start_nats(port, tmp_path / "js")
    yield f"nats://127.0.0.1:{port}"
    stop_process(proc)


class EtcdServer:
    """One etcd member on fixed ports and a data dir: ``stop()`` and ``start()`` again restart it in place."""

    def __init__(self) -> None:
        self.port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"  # the --etcd-endpoint value
        self.data_dir = Path(tempfile.mkdtemp(prefix="infera-etcd-"))
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = start_etcd(self.port, self.data_dir, self.peer_port)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


@pytest.fixture
def etcd_server():
    """A fresh one-member etcd (``.endpoint`` = host:port), stopped and its data dir removed after the test."""
    server = EtcdServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)


@pytest.fixture
def model_dir() -> Path:
    return MODEL_DIR


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child services: no inherited INFERA_* settings, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env
