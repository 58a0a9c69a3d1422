"""Moves batches of one shape through an initiator: `inflight` batches kept in flight (the oldest
waited for, then its slot's next batch submitted), one untimed warm-up batch per slot, then
`runs` timed runs; GB/s per run and the latency of every timed batch (submit to completion)."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

from .engine import Initiator
from .work import Shape, Slots

# A batch that takes longer than this has failed, whatever the engine says (64 MiB in 30 s is
# 2 MB/s, far below any path measured here).
BATCH_DEADLINE_S = 30.0


@dataclasses.dataclass
class Measured:
    gbps_runs: list[float]
    latencies_s: list[float]
    batches: int
    bytes: int

    @property
    def gbps(self) -> float:
        return statistics.median(self.gbps_runs)

    def percentile_us(self, q: float) -> float:
        """Nearest rank, like kvfabric bench."""
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        rank = min(len(ordered), max(1, int(-(-len(ordered) * q // 1))))
        return ordered[rank - 1] * 1e6


Window = collections.deque[tuple[int, object, float]]


def _submit(initiator: Initiator, shape: Shape, slots: Slots, slot: int, window: Window) -> None:
    """A batch's latency runs from its submission (its ops already chosen, as in kvfabric bench)
    to the wait that sees it done."""
    batch = slots.next(slot)
    began = time.perf_counter()
    window.append((slot, initiator.submit(shape.op, batch), began))


def _fill(initiator: Initiator, shape: Shape, slots: Slots) -> Window:
    window: Window = collections.deque()
    for k in range(shape.inflight):
        _submit(initiator, shape, slots, k, window)
    return window


def measure(
    initiator: Initiator, shape: Shape, slots: Slots, progress: object | None = None
) -> Measured:
    """`progress`, when given, is a tqdm bar counting timed seconds."""
    window = _fill(initiator, shape, slots)
    while window:
        _, handle, _ = window.popleft()
        initiator.wait(handle, time.monotonic() + BATCH_DEADLINE_S)
    out = Measured([], [], 0, 0)
    span = shape.seconds / shape.runs
    for _ in range(shape.runs):
        start = time.perf_counter()
        moved = 0
        window = _fill(initiator, shape, slots)
        shown = 0.0
        while window:
            slot, handle, submitted = window.popleft()
            initiator.wait(handle, time.monotonic() + BATCH_DEADLINE_S)
            now = time.perf_counter()
            out.latencies_s.append(now - submitted)
            moved += shape.batch_bytes
            out.batches += 1
            if now - start < span:
                _submit(initiator, shape, slots, slot, window)
            if progress is not None and now - start - shown >= 0.1:
                step = min(now - start, span) - shown
                progress.update(step)  # type: ignore[attr-defined]
                shown += step
        elapsed = time.perf_counter() - start
        if progress is not None:
            progress.update(max(0.0, span - shown))  # type: ignore[attr-defined]
        out.gbps_runs.append(moved / elapsed / 1e9)
        out.bytes += moved
    return out
