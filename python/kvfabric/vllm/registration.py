"""A segment this process keeps registered with its node's agent, and the event loop its
transfers run on.

An agent that restarts forgets the segments registered with it; :class:`Registration` checks
every ``check_interval_s`` that its segment is still served (an 8-byte copy within the segment,
which only the agent holding the registration can do: a registry entry a previous agent left
does not count) and registers it again, with the same name and key, so params already handed
out stay valid.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any

import kvfabric
from kvfabric.errors import KvfabricError

log = logging.getLogger("vllm.kvfabric")

WORD = 8
# What a probe hears from an agent that does not serve the segment (any more).
GONE = ("NOT_FOUND", "PERMISSION_DENIED")


class Loop:
    """An asyncio loop on a thread of its own: the engine's threads never wait on a transfer."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float) -> None:
        """Cancels what is still running and lets it unwind (within ``timeout``), then stops
        the loop and joins its thread."""
        if self.thread.is_alive():

            async def cancel_all() -> None:
                tasks = asyncio.all_tasks() - {asyncio.current_task()}
                for t in tasks:
                    t.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=timeout)

            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout + 1)
            except Exception as e:  # noqa: BLE001 - stopping anyway
                log.debug("kvfabric: stopping %s: %s", self.thread.name, e)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()


class Registration:
    """``memory`` registered as segment ``name`` under ``key``; ``probe`` is ``(region,
    offset)`` of two scratch words in it."""

    def __init__(
        self,
        client: kvfabric.Client,
        name: str,
        memory: Sequence[Any],
        key: int,
        probe: tuple[int, int],
        check_interval_s: float,
        call_timeout_s: float,
    ) -> None:
        self.client = client
        self.name = name
        self.memory = list(memory)
        self.key = key
        self.probe = probe
        self.check_interval_s = check_interval_s
        self.call_timeout_s = call_timeout_s
        self.segment: kvfabric.Segment | None = None
        self.stopping = threading.Event()
        self.keeper = threading.Thread(target=self._keep, name=f"kvfabric-keep-{name}", daemon=True)
        self._register()
        self.keeper.start()

    def _register(self) -> None:
        self.segment = self.client.register(self.name, self.memory, key=self.key)
        log.info("kvfabric: registered %s (%d regions)", self.name, len(self.memory))

    def registered(self) -> bool:
        """Whether the agent still serves the segment. Only an agent that says it does not know
        the segment (NOT_FOUND) or holds it under another key (PERMISSION_DENIED) means it is
        gone; anything else (down, busy, a deadline, a lease being renewed) says nothing about
        the registration and is tried again at the next check."""
        return self._probe() is None

    def _probe(self) -> KvfabricError | None:
        """None if the probe read within the segment went through, else why it failed; raises
        only when the failure says the segment is gone."""
        region, offset = self.probe
        try:
            self.client.read(
                self.segment,
                self.name,
                self.key,
                [region],
                [offset + WORD],
                [region],
                [offset],
                [WORD],
                timeout=self.call_timeout_s,
            )
            return None
        except KvfabricError as e:
            if getattr(e, "code", "") in GONE:
                raise
            return e

    def _keep(self) -> None:
        while not self.stopping.wait(self.check_interval_s):
            try:
                why = self._probe()
            except KvfabricError as e:
                self._register_again(e)
                continue
            if why is not None:
                log.debug("kvfabric: probing %s: %s (checked again)", self.name, why)

    def _register_again(self, gone: KvfabricError) -> None:
        log.info("kvfabric: %s is not served (%s); registering it again", self.name, gone)
        while not self.stopping.is_set():
            try:
                self._register()
                return
            except KvfabricError as e:
                # ALREADY_EXISTS: the registry still holds a previous agent's entry (it goes
                # with that agent's lease), or the probe's verdict was stale and the agent
                # serves it after all: probe again before the next try.
                try:
                    if self._probe() is None:
                        log.info("kvfabric: %s is served again", self.name)
                        return
                except KvfabricError:
                    pass
                log.info("kvfabric: registering %s again: %s", self.name, e)
                self.stopping.wait(self.check_interval_s)

    def close(self) -> None:
        """Stops the keeper (joined) and deregisters the segment."""
        self.stopping.set()
        if self.keeper.is_alive():
            self.keeper.join(self.check_interval_s + self.call_timeout_s)
        if self.segment is not None:
            try:
                self.client.deregister(self.segment)
            except KvfabricError as e:
                log.info("kvfabric: deregistering %s: %s", self.name, e)
            self.segment = None
