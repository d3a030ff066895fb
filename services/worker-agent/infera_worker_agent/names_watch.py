"""The engine's served names while it serves: its ``/v1/models`` read again every ``--models-interval``
seconds, so that LoRA adapters loaded or unloaded at run time (vLLM's ``/v1/load_lora_adapter``,
SGLang's ``/load_lora_adapter``) join or leave the worker's record, and requests for them are routed
here or no longer. SGLang reloads any adapter it ever loaded when a request names it (its LoRA
reference cache: one evicted by ``--max-loaded-loras`` or unloaded leaves its ``/v1/models`` but is
still served), so for it an adapter once seen stays in the record (``sticky``). A vLLM engine's
filesystem LoRA resolver loads adapters that are in no list until a request names them: those are
added (``resolvable``, ``lora_resolver.py``). ``changed`` and ``merged`` are the pure part."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

import aiohttp
import structlog

from infera_common.tasks import stop_tasks
from infera_worker_agent.health import ModelCard, served_model

log = structlog.get_logger("infera.worker_agent")


def changed(old: ModelCard, new: ModelCard) -> dict[str, list[str]]:
    """What a record learns from a fresh card: names added and removed (empty: nothing to register).
    A card of another model (an engine restarted on other weights) changes nothing here: the record's
    model is the one the engine started with."""
    if new.id != old.id:
        return {}
    if (set(old.aliases), set(old.adapters)) == (set(new.aliases), set(new.adapters)):
        return {}  # (the same names in another order)
    before, after = {*old.aliases, *old.adapters}, {*new.aliases, *new.adapters}
    return {"added": sorted(after - before), "removed": sorted(before - after)}


def merged(old: ModelCard, new: ModelCard) -> ModelCard:
    """``new`` with every adapter of ``old`` kept (those first, in their order): an engine that still
    serves what it no longer lists (SGLang)."""
    adapters = tuple(dict.fromkeys([*old.adapters, *new.adapters]))
    return replace(new, adapters=tuple(a for a in adapters if a not in new.aliases))


class NamesWatch:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval: float, current: ModelCard,
                 on_change: Callable[[ModelCard], Awaitable[None]], sticky: bool = False,
                 resolvable: Callable[[ModelCard], Awaitable[ModelCard]] | None = None) -> None:
        self._session = session
        self._url = base_url
        self.interval = interval
        self.current = current
        self._on_change = on_change
        self._sticky = sticky
        self._resolvable = resolvable  # the card with the adapters the engine loads on first use
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="names-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks(task)

    async def check_once(self) -> bool:
        """Read the card once; register what changed. True when something did."""
        card = await served_model(self._session, self._url, attempts=1)
        if card is not None and self._sticky:
            card = merged(self.current, card)
        if card is not None and self._resolvable is not None:
            card = await self._resolvable(card)
        diff = changed(self.current, card) if card is not None else {}
        if not diff:
            return False
        self.current = card  # type: ignore[assignment]
        log.info("engine_served_names_changed", model=card.id, adapters=list(card.adapters),  # type: ignore[union-attr]
                 aliases=list(card.aliases), **diff)  # type: ignore[union-attr]
        await self._on_change(card)  # type: ignore[arg-type]
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_once()
            except Exception as exc:  # a bad answer must not end the watch
                log.warning("engine_models_check_failed", error=str(exc) or type(exc).__name__)
