"""How long the frontend's event loop stands still while a worker thread tokenizes one long prompt.

The frontend tokenizes prompts longer than ``OFFLOAD_CHARS`` in a worker thread. ``tokenizers``'
plain ``encode`` keeps the GIL for much of the call, so the loop, and every other request on it,
waits anyway; ``ChatTokenizer.encode`` sends long texts through ``encode_batch``, which releases
it. Baseline: the plain ``encode`` in the same run. A probe task sleeps 10 ms in a loop; the figure
is its worst overshoot while the thread encodes.

    .venv/bin/python bench/tokenizer_gil.py [--mb 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from infera_common.models import default_model_path
from infera_common.tokenizer import ChatTokenizer


async def _worst_lag(stop: asyncio.Event) -> float:
    worst = 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        worst = max(worst, time.perf_counter() - t - 0.01)
    return worst


async def _measure(encode) -> tuple[float, float]:
    stop = asyncio.Event()
    probe = asyncio.create_task(_worst_lag(stop))
    t = time.perf_counter()
    await asyncio.to_thread(encode)
    took = time.perf_counter() - t
    stop.set()
    return took, await probe


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=6.0, help="prompt size in MB of text (default 6)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of each path (default 3)")
    args = ap.parse_args()
    tok = ChatTokenizer.from_dir(default_model_path())
    text = tok.render_chat([{"role": "user", "content": "hello world. " * int(args.mb * 1e6 / 13)}])
    paths = {
        "tokenizers encode (baseline)": lambda: tok.tokenizer.encode(text, add_special_tokens=False).ids,
        "ChatTokenizer.encode": lambda: tok.encode(text),
    }
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            got[name].append(await _measure(fn))
    print(f"prompt: {len(text):,} characters; {args.rounds} rounds, alternating")
    print("| path | encode s (median) | worst loop stall s (median) | max |")
    print("|---|---|---|---|")
    for name, rows in got.items():
        print(f"| {name} | {statistics.median(r[0] for r in rows):.2f} | "
              f"{statistics.median(r[1] for r in rows):.2f} | {max(r[1] for r in rows):.2f} |")
    base = statistics.median(r[1] for r in got["tokenizers encode (baseline)"])
    ours = statistics.median(r[1] for r in got["ChatTokenizer.encode"])
    print(f"loop stall, ChatTokenizer.encode vs baseline: {ours / base:.2f}x" if base > 0 else "baseline never stalled")


if __name__ == "__main__":
    asyncio.run(main())
