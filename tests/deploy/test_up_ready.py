"""`infera up` waits for the fleet as long as it makes progress: a large fleet on few cores takes
longer than --ready-timeout in all, its workers turning active one after another."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infera.up import _wait_ready


@pytest.fixture
def frontend():
    """A /v1/workers that lists one more active worker every ``step`` seconds, up to ``most``."""
    state = {"t0": time.monotonic(), "step": 0.25, "most": 6}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            n = min(int((time.monotonic() - state["t0"]) / state["step"]), state["most"])
            body = json.dumps({"data": [{"worker_id": f"w{i}", "status": "active"} for i in range(n)]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()


def test_a_fleet_that_keeps_making_progress_is_waited_for_past_the_timeout(frontend, tmp_path):
    url, state = frontend
    # 6 workers, one every 0.25 s: 1.5 s in all, against a timeout of 1 s without progress
    active = _wait_ready(url, 6, 1.0, [], lambda: False, tmp_path)
    assert active is not None and len(active) == 6


def test_a_fleet_that_stops_making_progress_gives_up_saying_how_far_it_got(frontend, tmp_path, capsys):
    url, state = frontend
    state["most"] = 2  # the third worker never turns active
    assert _wait_ready(url, 3, 1.0, [], lambda: False, tmp_path) is None
    err = capsys.readouterr().err
    assert "2 of 3 workers active (2 listed)" in err and "raise --ready-timeout" in err
