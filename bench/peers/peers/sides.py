"""The two processes of a peer row: `serve` (the target, which owns the pool pushed into or
pulled from) and `drive` (the initiator, which runs the rows and prints one JSON line each)."""

from __future__ import annotations

import dataclasses
import json
import secrets
import socket
import sys
import traceback
from typing import Any

import numpy as np

from . import control, drivers, pool, timing
from .engine import Link
from .errors import Kind, PeerError
from .work import Shape, Slots

# A row that fails this way is the engine's or our failure to report, not a crash.
_ROW_ERRORS = (PeerError, RuntimeError, ValueError, OSError, TypeError, KeyError)


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def serve(engine: str, link: Link, token: str) -> None:
    driver = drivers.load(engine)
    target = driver.Target(link)
    listener = socket.create_server((link.host, 0))
    _say(
        {
            "control": f"{link.host}:{listener.getsockname()[1]}",
            "engine": engine,
            "version": driver.version(),
        }
    )
    held: pool.HostPool | pool.CudaPool | None = None
    while True:
        conn, _ = listener.accept()
        # A row runs between two requests: the target waits that long, but not forever.
        conn.settimeout(control.IDLE_S)
        with conn:
            try:
                first, _ = control.recv(conn)
            except (PeerError, OSError):
                continue
            if first.get("op") != "hello" or not control.authentic(first, token):
                continue  # a stranger learns nothing, not even why
            control.send(conn, {"engine": engine, "version": driver.version()})
            while True:
                try:
                    message, attachment = control.recv(conn)
                except (PeerError, OSError) as e:
                    print(f"peers serve: control connection ended: {e}", file=sys.stderr)
                    break
                op = message.get("op")
                if op == "bye":
                    break
                if op == "quit":
                    target.close()
                    return
                try:
                    if op == "prepare":
                        target.withdraw()
                        held = None
                        held = pool.alloc(
                            int(message["pool_bytes"]), int(message["block_size"]), link.device
                        )
                        held.fill(int(message["seed"]))
                        control.send(conn, {"remote": target.expose(held)})
                    elif op == "verify":
                        if held is None:
                            raise PeerError(Kind.CONTROL, "verify", "no pool prepared")
                        source_of = np.frombuffer(attachment, dtype=np.int64)
                        verdict = held.verify(
                            source_of, int(message["source_seed"]), int(message["poison_seed"])
                        )
                        control.send(conn, {"verdict": verdict.to_json()})
                    elif op == "release":
                        target.withdraw()
                        held = None
                        control.send(conn, {})
                    else:
                        control.send(conn, {"error": f"unknown op {str(op)[:40]!r}"})
                except _ROW_ERRORS as e:
                    control.send(conn, {"error": f"{type(e).__name__}: {e}"})


@dataclasses.dataclass(frozen=True)
class Row:
    """What `drive` measures for one shape; `verified` is false with `error` or `verdict`."""

    engine: str
    version: str
    path: str
    transport: str
    location: str
    op: str
    block_size: int
    blocks_per_batch: int
    inflight: int
    pool_bytes: int
    batches: int = 0
    bytes: int = 0
    gbps: float | None = None
    gbps_runs: tuple[float, ...] = ()
    p50_us: float | None = None
    p99_us: float | None = None
    verified: bool = False
    verdict: dict[str, Any] | None = None
    error: str | None = None


def run_row(
    initiator: Any,
    client: control.Client,
    shape: Shape,
    link: Link,
    progress: Any,
    kept: list[pool.HostPool | pool.CudaPool],
) -> dict[str, Any]:
    """One row: pools prepared and poisoned, timed runs, every destination block checked. A row
    that fails leaves its pool in `kept`: the engine may still be moving bytes into it."""
    local_seed, remote_seed = secrets.randbits(63), secrets.randbits(63)
    reply = client.call(
        {
            "op": "prepare",
            "pool_bytes": shape.pool_bytes,
            "block_size": shape.block_size,
            "seed": remote_seed,
        }
    )
    mine = pool.alloc(shape.pool_bytes, shape.block_size, link.device)
    mine.fill(local_seed)
    try:
        initiator.attach(mine, reply["remote"])
        slots = Slots(shape, secrets.randbits(63))
        measured = timing.measure(initiator, shape, slots, progress)
        initiator.detach()
    except BaseException:
        kept.append(mine)
        raise
    if shape.op == "read":
        verdict = mine.verify(slots.source_of, remote_seed, local_seed).to_json()
    else:
        verdict = client.call(
            {"op": "verify", "source_seed": local_seed, "poison_seed": remote_seed},
            slots.source_of.tobytes(),
        )["verdict"]
    client.call({"op": "release"})
    return {
        "batches": measured.batches,
        "bytes": measured.bytes,
        "gbps": measured.gbps,
        "gbps_runs": measured.gbps_runs,
        "p50_us": measured.percentile_us(0.5),
        "p99_us": measured.percentile_us(0.99),
        "verdict": verdict,
        "verified": verdict["mismatches"] == 0,
    }


def drive(
    engine: str,
    link: Link,
    address: str,
    token: str,
    shapes: list[Shape],
    path: str,
    show_progress: bool,
) -> int:
    """Runs every shape; prints one JSON row each. Returns the number of rows not verified.
    After a batch missed its deadline the engine may still be moving that row's bytes, so the
    rows after it are not run (each says why)."""
    from tqdm import tqdm

    driver = drivers.load(engine)
    version = driver.version()
    location = "host" if link.device is None else f"cuda:{link.device}"
    failed = 0
    client: control.Client | None = None
    initiator: Any = None
    kept: list[pool.HostPool | pool.CudaPool] = []
    stuck: str | None = None
    for shape in shapes:
        base = Row(
            engine,
            version,
            path,
            link.transport,
            location,
            shape.op,
            shape.block_size,
            shape.per_batch,
            shape.inflight,
            shape.pool_bytes,
        )
        if stuck is not None:
            failed += 1
            _say(dataclasses.asdict(dataclasses.replace(base, error=f"not run: {stuck}")))
            continue
        bar = tqdm(
            total=shape.seconds,
            desc=f"{engine} {path} {shape.op} {shape.block_size >> 10}K",
            unit="s",
            bar_format="{desc:>32} {bar:30} {n:.1f}/{total:.1f} s",
            disable=not show_progress,
            file=sys.stderr,
            leave=False,
        )
        try:
            shape.validate()
            if client is None:
                client = control.Client(address, token)
            if initiator is None:
                initiator = driver.Initiator(link)
            row = dataclasses.replace(base, **run_row(initiator, client, shape, link, bar, kept))
        except _ROW_ERRORS as e:
            traceback.print_exc(file=sys.stderr)
            row = dataclasses.replace(base, error=f"{type(e).__name__}: {e}")
            if isinstance(e, PeerError) and e.kind is Kind.TIMEOUT:
                stuck = f"an earlier row timed out ({e})"
        finally:
            bar.close()
        failed += not row.verified
        _say(dataclasses.asdict(row))
    if client is not None:
        client.close()
    if initiator is not None:
        initiator.close()
    return failed
