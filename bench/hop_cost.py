"""What one hop between processes costs on this machine, back to back and after the idle time a
request spends waiting for its engine: the floor under `bench/overhead.py`'s added latency.

A request through Infera crosses more process boundaries than one sent straight to the engine (on
the NATS plane: frontend, nats-server, router, kv-indexer, worker-agent; on the no-broker plane:
one `infera.server`). Each crossing wakes a process that slept while the engine worked. This
measures three round trips, each between two processes of its own, with a gap between requests
(0 = back to back; 60 ms = about one short request's engine time at speedup 1):

- ``socket``: a one-byte ping-pong over a Unix socket pair (the kernel's and the VM's part alone);
- ``http``: an aiohttp GET to a trivial aiohttp handler;
- ``nats``: a nats-py request to a nats-py responder through a local nats-server (two hops).

    .venv/bin/python bench/hop_cost.py [--rounds 300] [--gaps 0 0.001 0.01 0.06]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import sys
import time

import aiohttp
import nats
from aiohttp import web

from benchfleet import nats_server
from infera.procs import free_port, wait_port


def _echo_socket(sock: socket.socket) -> None:
    while data := sock.recv(16):
        sock.send(data)


def _echo_http(port: int) -> None:
    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


def _echo_nats(url: str) -> None:
    async def serve() -> None:
        nc = await nats.connect(url)

        async def answer(msg) -> None:
            await msg.respond(msg.data)

        await nc.subscribe("hop.echo", cb=answer)
        await asyncio.Event().wait()

    asyncio.run(serve())


def _p50_us(samples: list[float]) -> float:
    return 1e6 * statistics.median(samples)


def socket_round_trips(gaps: list[float], rounds: int) -> dict[float, float]:
    a, b = socket.socketpair()
    child = mp.Process(target=_echo_socket, args=(b,), daemon=True)
    child.start()
    out = {}
    try:
        for gap in gaps:
            lat = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                a.send(b"x")
                a.recv(16)
                lat.append(time.perf_counter() - t0)
                if gap:
                    time.sleep(gap)
            out[gap] = _p50_us(lat)
    finally:
        a.shutdown(socket.SHUT_RDWR)  # the child holds a copy of ``a`` too: close() alone sends no EOF
        a.close()
        child.join(5)
        child.kill()
    return out


async def _timed(gaps: list[float], rounds: int, call) -> dict[float, float]:
    out = {}
    for _ in range(20):  # warm-up
        await call()
    for gap in gaps:
        lat = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t0)
            if gap:
                await asyncio.sleep(gap)
        out[gap] = _p50_us(lat)
    return out


def http_round_trips(gaps: list[float], rounds: int) -> dict[float, float]:
    port = free_port()
    child = mp.Process(target=_echo_http, args=(port,), daemon=True)
    child.start()
    try:
        wait_port("127.0.0.1", port, 30)

        async def run() -> dict[float, float]:
            async with aiohttp.ClientSession() as session:
                async def call() -> None:
                    async with session.get(f"http://127.0.0.1:{port}/") as resp:
                        await resp.read()

                return await _timed(gaps, rounds, call)

        return asyncio.run(run())
    finally:
        child.kill()
        child.join(5)


def nats_round_trips(gaps: list[float], rounds: int) -> dict[float, float]:
    with nats_server("hop-nats-") as url:
        child = mp.Process(target=_echo_nats, args=(url,), daemon=True)
        child.start()
        try:
            async def run() -> dict[float, float]:
                nc = await nats.connect(url)
                try:
                    for _ in range(100):  # until the responder has subscribed
                        try:
                            await nc.request("hop.echo", b"x", timeout=0.5)
                            break
                        except Exception:
                            await asyncio.sleep(0.1)

                    async def call() -> None:
                        await nc.request("hop.echo", b"x", timeout=5)

                    return await _timed(gaps, rounds, call)
                finally:
                    await nc.close()

            return asyncio.run(run())
        finally:
            child.kill()
            child.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300, help="round trips per cell")
    ap.add_argument("--gaps", type=float, nargs="+", default=[0.0, 0.001, 0.01, 0.06],
                    help="idle seconds between round trips")
    args = ap.parse_args()
    gaps = sorted(set(args.gaps) | {0.0})
    rows = {
        "socket": socket_round_trips(gaps, args.rounds),
        "http": http_round_trips(gaps, args.rounds),
        "nats": nats_round_trips(gaps, args.rounds),
    }
    print(f"\nround trip p50 in µs between two processes, by idle gap before each ({args.rounds} per cell); "
          f"python {sys.version.split()[0]}\n")
    hdr = f"{'kind':<7}" + "".join(f" | {f'gap {g * 1000:g} ms':>14}" for g in gaps) + f" | after {gaps[-1] * 1000:g} ms idle vs back to back"
    print(hdr)
    print("-" * len(hdr))
    for kind, cells in rows.items():
        last = cells[gaps[-1]]
        print(f"{kind:<7}" + "".join(f" | {cells[g]:>14.0f}" for g in gaps)
              + f" | {last / cells[0.0]:.1f}x (+{last - cells[0.0]:.0f} µs)")


if __name__ == "__main__":
    main()
