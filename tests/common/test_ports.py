"""Listening ports are picked below the kernel's ephemeral range (infera_common.ports)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from infera_common.ports import CLAIM_TTL, bindable, claim, ephemeral_range, free_port, free_port_block, listen_ports


def test_ports_are_picked_outside_the_range_outgoing_connections_draw_from():
    first, last = ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert not first <= port <= last
        assert bindable("127.0.0.1", port)
    taken: set[int] = set()
    base = free_port_block(4, taken)
    assert taken == set(range(base, base + 4)) and not any(first <= p <= last for p in taken)
    assert free_port_block(4, taken) not in range(base - 3, base + 4)  # blocks never overlap


def test_a_range_that_leaves_no_room_below_is_avoided_above_then_anywhere():
    assert listen_ports((32768, 60999)) == range(10000, 32768)
    assert listen_ports((1024, 40000)) == range(40001, 65536)
    assert listen_ports((1024, 65000)) == range(1024, 65536)


def test_an_unreadable_range_falls_back_to_the_linux_default(tmp_path):
    bad = tmp_path / "range"
    bad.write_text("not numbers")
    assert ephemeral_range(str(bad)) == (32768, 60999)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_a_port_in_use_is_not_handed_out_and_when_every_pick_is_taken_the_kernel_chooses():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        held = s.getsockname()[1]
        assert not bindable("127.0.0.1", held)
        port = free_port(attempts=3, is_free=lambda host, p: False)  # nothing below the range is free
        assert port != held and bindable("127.0.0.1", port)


def test_a_port_picked_by_one_process_is_not_picked_by_another_until_its_claim_is_old(tmp_path, monkeypatch):
    """Two worker-agents starting together picked the same engine port (a CI failure)."""
    claims = tmp_path / "claims"
    assert claim(15930, claims, now=1000.0)  # one agent's pick
    assert not claim(15930, claims, now=1000.0 + 60)  # another's, a minute later: taken
    assert claim(15931, claims, now=1060.0)
    assert claim(15930, claims, now=(claims / "15930").stat().st_mtime + CLAIM_TTL)  # an old claim lapses

    # a claim whose process has ended lapses at once, whatever its age
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (claims / "15932").write_text(done.stdout.strip())
    assert claim(15932, claims) and (claims / "15932").read_text() == str(os.getpid())
    assert not claim(15932, claims)  # now this (running) process's

    picks = iter([20000, 20000, 20001])  # the second pick repeats the first
    monkeypatch.setattr("infera_common.ports._random.choice", lambda ports: next(picks))
    fresh = tmp_path / "fresh"
    pick = lambda: free_port(is_free=lambda h, p: True, claim_port=lambda p: claim(p, fresh))  # noqa: E731
    assert [pick(), pick()] == [20000, 20001]
    assert free_port_block(2, set(), claim_port=lambda p: claim(p, fresh)) not in (19999, 20000, 20001)


def test_without_a_writable_claims_directory_ports_are_still_handed_out(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert claim(15000, blocker / "claims")  # cannot be created: the bind check alone decides
