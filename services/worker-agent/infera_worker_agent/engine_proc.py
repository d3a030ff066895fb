"""The engine as a child process: spawn in its own process group, tie its life to the agent, stop it.

Two ties, so the engine never outlives the agent: PR_SET_PDEATHSIG (SIGTERM to the engine's main
process when the agent dies) and the watchdog process (``watchdog.py``), which stops the engine's
whole process group - children included - when the agent's pipe closes.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from typing import BinaryIO

from infera_common.logs import get_logger
from infera_worker_agent.engine_cmd import redacted

log = get_logger("worker_agent.engine")

PR_SET_PDEATHSIG = 1

try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _PRCTL = _LIBC.prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # not Linux: the watchdog alone ties the engine to the agent
    _PRCTL = None


def exit_status(returncode: int | None) -> int:
    """A process exit code as a shell reports it: 128+N for death by signal N; never 0 for a failure."""
    if returncode is None:
        return 1
    if returncode < 0:
        return 128 - returncode
    return returncode or 1


def _die_with_parent(parent_pid: int):
    def preexec() -> None:  # runs in the child between fork and exec: no Python-level locks here
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the agent died before prctl took effect
            os._exit(1)

    return preexec


#: Engine output held back while no newline ends it (a secret is only replaced within whole lines).
LONGEST_LINE = 65536


def hide_secrets(data: bytes, secrets: Sequence[bytes]) -> bytes:
    for secret in secrets:
        data = data.replace(secret, b"***")
    return data


class EngineProcess:
    def __init__(self, proc: asyncio.subprocess.Process, watchdog: subprocess.Popen, watchdog_fd: int,
                 echo: BinaryIO | None, tail_lines: int, secrets: Sequence[str] = ()) -> None:
        self._proc = proc
        self._watchdog = watchdog
        self._watchdog_fd: int | None = watchdog_fd
        self._echo = echo
        # engines print their arguments as they start (vLLM's non-default args, SGLang's server_args),
        # an --api-key included: echoed and kept with it replaced
        self._secrets = [s.encode() for s in secrets if s]
        self._tail: deque[str] = deque(maxlen=tail_lines)
        self._last = b""  # the output's unfinished last line
        self._pump = asyncio.create_task(self._read_output(), name="engine-output")

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        grace: float,
        echo: BinaryIO | None = None,
        env: dict[str, str] | None = None,
        tail_lines: int = 40,
        secrets: Sequence[str] = (),
    ) -> "EngineProcess":
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,  # own session and process group: pgid == pid
            preexec_fn=_die_with_parent(os.getpid()),
        )
        read_fd, write_fd = os.pipe()  # both non-inheritable: the engine never holds the write end
        try:
            watchdog = subprocess.Popen(
                [sys.executable, "-m", "infera_worker_agent.watchdog", str(proc.pid), str(grace)],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except Exception:
            os.close(write_fd)
            _signal_group(proc.pid, signal.SIGKILL)
            raise
        finally:
            os.close(read_fd)
        log.info("engine_spawned", pid=proc.pid, watchdog_pid=watchdog.pid, argv=redacted(argv))
        return cls(proc, watchdog, write_fd, echo, tail_lines, secrets)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def watchdog_pid(self) -> int:
        return self._watchdog.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def tail(self) -> list[str]:
        """The engine's last lines of output."""
        return list(self._tail)

    async def wait(self) -> int:
        return await self._proc.wait()

    async def stop(self, timeout: float) -> int:
        """SIGTERM the engine's process group, SIGKILL it after ``timeout``; returns the exit code."""
        if self._proc.returncode is None:
            log.info("engine_stopping", pid=self.pid, timeout=timeout)
            _signal_group(self.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), timeout)
            except TimeoutError:
                log.warning("engine_stop_timeout", pid=self.pid)
                _signal_group(self.pid, signal.SIGKILL)
                await self._proc.wait()
        _signal_group(self.pid, signal.SIGKILL)  # children left behind by the engine's main process
        await self.close()
        return self._proc.returncode  # type: ignore[return-value]

    async def close(self) -> None:
        """Release the watchdog (the engine is stopped) and stop reading output."""
        if self._watchdog_fd is not None:
            try:
                os.write(self._watchdog_fd, b"release")
            except OSError:
                pass
            os.close(self._watchdog_fd)
            self._watchdog_fd = None
            try:
                await asyncio.to_thread(self._watchdog.wait, 5)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()
        try:
            await asyncio.wait_for(asyncio.shield(self._pump), 1.0)
        except (TimeoutError, asyncio.CancelledError):
            self._pump.cancel()

    async def _read_output(self) -> None:
        assert self._proc.stdout is not None
        partial = b""
        while True:
            chunk = await self._proc.stdout.read(65536)
            if not chunk:
                break
            data = partial + chunk
            cut = data.rfind(b"\n") + 1
            if not self._secrets:
                cut = len(data)
            elif not cut and len(data) > LONGEST_LINE:  # no line end for that long: let it through
                cut = len(data)
            self._emit(hide_secrets(data[:cut], self._secrets))
            partial = data[cut:]
        self._emit(hide_secrets(partial, self._secrets))
        if self._last:
            self._tail.append(self._last.decode("utf-8", "replace")[:2000])

    def _emit(self, data: bytes) -> None:
        """Echo the output, and keep its last lines (``tail``)."""
        if not data:
            return
        if self._echo is not None:
            try:
                self._echo.write(data)
                self._echo.flush()
            except (OSError, ValueError):
                self._echo = None
        lines = (self._last + data).split(b"\n")
        self._last = lines.pop()[-8192:]
        self._tail.extend(line.decode("utf-8", "replace")[:2000] for line in lines)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
