"""The engine's process group is tied to the agent: stopped on request, and when the agent dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

from infera_worker_agent.engine_proc import EngineProcess, exit_status

from .agent_proc import alive, group_members, wait_until

# An "engine" that starts a child in its own process group, says so, and runs until killed.
FAMILY = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    time.sleep(600)
""")


async def _child_pid(engine: EngineProcess) -> int:
    for _ in range(200):
        for line in engine.tail():
            if line.startswith("child "):
                return int(line.split()[1])
        await asyncio.sleep(0.05)
    raise AssertionError(f"no child line in {engine.tail()}")


async def test_stop_ends_the_whole_process_group_and_releases_the_watchdog():
    engine = await EngineProcess.spawn([sys.executable, "-c", FAMILY], grace=2.0)
    child = await _child_pid(engine)
    assert os.getpgid(child) == engine.pid
    await engine.stop(timeout=2.0)
    assert engine.returncode is not None
    assert wait_until(lambda: not alive(child) and not group_members(engine.pid), 5)
    assert wait_until(lambda: not alive(engine.watchdog_pid), 5)


async def test_exit_is_seen_with_code_and_output_tail():
    engine = await EngineProcess.spawn(
        [sys.executable, "-c", "import sys; print('bad flag --foo'); sys.exit(3)"], grace=1.0
    )
    assert await engine.wait() == 3
    await engine.close()
    assert "bad flag --foo" in engine.tail()
    assert exit_status(3) == 3 and exit_status(-9) == 137 and exit_status(0) == 1 and exit_status(None) == 1


async def test_an_engine_printing_its_api_key_is_echoed_and_kept_without_it(tmp_path):
    # as engines print their arguments at start; the key split over two writes, the last line unended
    script = ("import sys, time; w = sys.stdout.write; w('args: api_key=sk-se'); sys.stdout.flush(); "
              "time.sleep(0.3); w('cret-9 port=1\\nready sk-secret-9'); sys.stdout.flush()")
    with open(tmp_path / "echo", "wb") as echo:
        engine = await EngineProcess.spawn([sys.executable, "-c", script], grace=1.0, echo=echo,
                                           secrets=["sk-secret-9"])
        assert await engine.wait() == 0
        await engine.close()
    assert (tmp_path / "echo").read_bytes() == b"args: api_key=*** port=1\nready ***"
    assert engine.tail() == ["args: api_key=*** port=1", "ready ***"]


def test_watchdog_kills_the_group_when_the_agent_pipe_closes():
    family = subprocess.Popen([sys.executable, "-c", FAMILY], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = int(family.stdout.readline().split()[1])
    read_fd, write_fd = os.pipe()
    watchdog = subprocess.Popen([sys.executable, "-m", "infera_worker_agent.watchdog", str(family.pid), "2"],
                                stdin=read_fd, start_new_session=True)
    os.close(read_fd)
    try:
        assert alive(family.pid) and alive(child)
        os.close(write_fd)  # what the kernel does when the agent dies, even by SIGKILL
        assert family.wait(10) == -signal.SIGTERM
        assert wait_until(lambda: not alive(child), 5)
        assert watchdog.wait(10) == 0
    finally:
        for p in (family.pid, child):
            if alive(p):
                os.kill(p, signal.SIGKILL)
        family.wait(5)


def test_released_watchdog_leaves_the_group_alone():
    family = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    read_fd, write_fd = os.pipe()
    watchdog = subprocess.Popen([sys.executable, "-m", "infera_worker_agent.watchdog", str(family.pid), "1"],
                                stdin=read_fd, start_new_session=True)
    os.close(read_fd)
    try:
        os.write(write_fd, b"release")
        os.close(write_fd)
        assert watchdog.wait(10) == 0
        assert alive(family.pid)
    finally:
        family.kill()
        family.wait(5)
