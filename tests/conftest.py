"""Shared fixtures: a real nats-server with JetStream on a free 127.0.0.1 port, per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from infera.procs import free_port, start_nats, stop_process

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


@pytest.fixture
def model_dir() -> Path:
    return MODEL_DIR


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child services: no inherited INFERA_* settings, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env
