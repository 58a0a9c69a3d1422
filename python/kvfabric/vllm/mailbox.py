"""An instance's mailbox: the words through which prefill and decode instances end holds.

Every instance registers one (segment ``<engine>.mailbox``, from its scheduler process) of
``4 * slots`` 64-bit words and two probe words:

- ``inbox[slot]``: a decode writes the hold's nonce there when it is done reading (the prefill
  then frees the blocks);
- ``renew[slot]``: a decode still meaning to read writes ``nonce + n`` there (``n`` = 1, 2,
  ...) while the request waits; each new value extends the lease;
- ``state[slot]``: the prefill keeps the hold's nonce there while the blocks are held and
  clears it *before* they are freed; a decode reads it after its pull, so a pull that may have
  read freed blocks is never used (the hold generation checked after the read);
- ``outbox``: words this instance stages for its own writes to other mailboxes.

Nonces are random and travel only in the request's params, so a decode can act only on the
holds it was handed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np

import kvfabric

from .params import Segment
from .registration import WORD, Loop, Registration

log = logging.getLogger("vllm.kvfabric")

_MASK = (1 << 64) - 1
MAX_RENEWALS = 1 << 32


def inbox_offset(slot: int) -> int:
    return slot * WORD


def renew_offset(slots: int, slot: int) -> int:
    return (slots + slot) * WORD


def state_offset(slots: int, slot: int) -> int:
    return (2 * slots + slot) * WORD


class Mailbox:
    def __init__(self, client: kvfabric.Client, name: str, slots: int, settings: Any) -> None:
        import secrets

        self.name = name
        self.slots = slots
        self.settings = settings
        self.key = secrets.randbits(63) | 1
        self.memory = kvfabric.host_array((4 * slots + 2) * WORD)
        words = self.memory.view(np.uint64)
        self.inbox = words[:slots]
        self.renew = words[slots : 2 * slots]
        self.state = words[2 * slots : 3 * slots]
        self.outbox = words[3 * slots : 4 * slots]
        self.free_out = list(range(slots - 1, -1, -1))
        self.out_lock = threading.Lock()
        self.client = client
        self.registration = Registration(
            client,
            name,
            [self.memory],
            self.key,
            (0, 4 * slots * WORD),
            settings.check_interval_s,
            settings.call_timeout_s,
        )
        self.loop = Loop(f"kvfabric-mailbox-{name}")

    @property
    def segment(self) -> Segment:
        return Segment(self.name, self.key)

    # -- holds of this instance (prefill side) ---------------------------------------------

    def hold(self, slot: int, nonce: int) -> None:
        self.inbox[slot] = 0
        self.renew[slot] = 0
        self.state[slot] = nonce

    def release(self, slot: int) -> None:
        """Revokes the hold: from now on a decode's check after its pull fails."""
        self.state[slot] = 0
        self.inbox[slot] = 0
        self.renew[slot] = 0

    def acked(self, slot: int, nonce: int) -> bool:
        return int(self.inbox[slot]) == nonce

    def renewal(self, slot: int, nonce: int) -> int:
        """The decode's latest renewal count for the hold (0: none)."""
        n = (int(self.renew[slot]) - nonce) & _MASK
        return n if 0 < n < MAX_RENEWALS else 0

    # -- holds of other instances (decode side) --------------------------------------------

    def send(
        self, target: Segment, target_slots: int, words: Iterable[tuple[int, int]]
    ) -> Future | None:
        """Writes ``(offset, value)`` words into ``target``'s mailbox, in the background; None
        when the outbox is full (the lease ends those holds instead)."""
        words = list(words)
        with self.out_lock:
            if len(words) > len(self.free_out):
                log.warning(
                    "kvfabric: mailbox %s: outbox full; %d words not sent", self.name, len(words)
                )
                return None
            out = [self.free_out.pop() for _ in words]
        for j, (_, value) in enumerate(words):
            self.outbox[out[j]] = value & _MASK
        base = 3 * self.slots * WORD
        return self.loop.run(self._send(target, out, [o for o, _ in words], base))

    async def _send(self, target: Segment, out: list[int], offsets: list[int], base: int) -> None:
        try:
            await self.client.write_async(
                self.registration.segment,
                target.name,
                target.key,
                np.zeros(len(out), np.uint64),
                np.asarray([base + j * WORD for j in out], np.uint64),
                np.zeros(len(out), np.uint64),
                np.asarray(offsets, np.uint64),
                np.full(len(out), WORD, np.uint64),
                timeout=self.settings.ack_timeout_s,
            )
        finally:
            with self.out_lock:
                self.free_out.extend(out)

    def ack(self, target: Segment, target_slots: int, slot: int, nonce: int) -> Future | None:
        return self.send(target, target_slots, [(inbox_offset(slot), nonce)])

    def renew_holds(
        self, target: Segment, target_slots: int, holds: Iterable[tuple[int, int, int]]
    ) -> Future | None:
        """``(slot, nonce, n)``: the n-th renewal of each hold."""
        return self.send(
            target,
            target_slots,
            [(renew_offset(target_slots, s), nonce + n) for s, nonce, n in holds],
        )

    def close(self) -> None:
        self.loop.stop(self.settings.ack_timeout_s + 1)
        self.registration.close()
