"""The same block batch through the Python binding and through the Rust client, against the
same two agents (etcd registry, tcp between them), alternating rounds, every byte verified.

    python python/benches/binding_vs_rust.py [--blocks 2048] [--block-bytes 4096] [--rounds 10]

Needs the release agent and the Rust side: ``cargo build --release -p kvfabric-cli --bin
kvfabric -p kvfabric-python --example client_batch`` (scripts/python-bench.sh does it all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fabric import REPO, Agent, Etcd  # noqa: E402

import kvfabric  # noqa: E402


class PythonSide:
    """The binding's side: memory registered once, then timed rounds."""

    def __init__(self, a: Agent, b: Agent, blocks: int, block: int, concurrency: int) -> None:
        self.src_c, self.dst_c = kvfabric.Client(a.socket_dir), kvfabric.Client(b.socket_dir)
        self.blocks, self.block = blocks, block
        self.src = kvfabric.host_array(blocks * block)
        self.src[:] = (np.arange(blocks * block, dtype=np.uint64) * 0x9E3779B9 >> 24).astype(
            np.uint8
        )
        self.dsts = [kvfabric.host_array(blocks * block) for _ in range(concurrency)]
        self.p = self.src_c.register("py-bench-src", [self.src])
        self.segs = [self.dst_c.register(f"py-bench-dst-{i}", [d]) for i, d in enumerate(self.dsts)]
        self.local_ids = np.arange(blocks, dtype=np.uint64)
        self.remote_ids = self.local_ids[::-1].copy()  # reversed: nothing coalesces

    def round_sync(self, seconds: float) -> tuple[float, float]:
        """The blocking calls, one thread per destination (they wait with the GIL released)."""
        plane = [(0, 0, self.block, self.block)]
        deadline = time.monotonic() + seconds
        results: list[tuple[int, int]] = []

        def loop(seg):
            n = nbytes = 0
            while time.monotonic() < deadline:
                t = self.dst_c.read_blocks(
                    seg, "py-bench-src", self.p.key, plane, plane, self.local_ids, self.remote_ids
                )
                n += 1
                nbytes += t.bytes
            results.append((n, nbytes))

        threads = [threading.Thread(target=loop, args=(s,)) for s in self.segs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        return sum(r[0] for r in results) / elapsed, sum(r[1] for r in results) / elapsed / 1e9

    async def round(self, seconds: float) -> tuple[float, float]:
        plane = [(0, 0, self.block, self.block)]
        deadline = time.monotonic() + seconds

        async def loop(seg):
            n = nbytes = 0
            while time.monotonic() < deadline:
                t = await self.dst_c.read_blocks_async(
                    seg,
                    "py-bench-src",
                    self.p.key,
                    plane,
                    plane,
                    self.local_ids,
                    self.remote_ids,
                )
                n += 1
                nbytes += t.bytes
            return n, nbytes

        t0 = time.perf_counter()
        results = await asyncio.gather(*[loop(s) for s in self.segs])
        elapsed = time.perf_counter() - t0
        return sum(r[0] for r in results) / elapsed, sum(r[1] for r in results) / elapsed / 1e9

    def close(self) -> None:
        want = self.src.reshape(self.blocks, self.block)[::-1]
        for d in self.dsts:
            if not np.array_equal(d.reshape(self.blocks, self.block), want):
                raise SystemExit("python side: a destination block differs from its source")
        for s in self.segs:
            self.dst_c.deregister(s)
        self.src_c.deregister(self.p)


class RustSide:
    """The Rust client's side: python/examples/client_batch.rs, one round per stdin line."""

    def __init__(self, a: Agent, b: Agent, blocks: int, block: int, concurrency: int) -> None:
        exe = REPO / "target" / "release" / "examples" / "client_batch"
        self.proc = subprocess.Popen(
            [str(exe), a.socket_dir, b.socket_dir, str(blocks), str(block), str(concurrency)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def round(self, seconds: float) -> tuple[float, float]:
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return r["batches"] / r["seconds"], r["bytes"] / r["seconds"] / 1e9

    def close(self) -> None:
        self.proc.stdin.close()
        if self.proc.wait(60) != 0:
            raise SystemExit("rust side failed (a destination block differs, or an agent error)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--api",
        choices=("async", "sync"),
        default="async",
        help="the binding's awaitable calls on one asyncio loop, or blocking calls in threads",
    )
    args = ap.parse_args()
    etcd = Etcd()
    a = Agent("bench-a", etcd=etcd.endpoint, extra=["--transports", "tcp"])
    b = Agent("bench-b", etcd=etcd.endpoint, extra=["--transports", "tcp"])
    rows: dict[str, list[tuple[float, float]]] = {"rust client": [], "python binding": []}
    try:
        rust = RustSide(a, b, args.blocks, args.block_bytes, args.concurrency)
        py = PythonSide(a, b, args.blocks, args.block_bytes, args.concurrency)
        loop = asyncio.new_event_loop()
        # A warm-up round each (connections, page faults), then alternating timed rounds.
        rust.round(args.seconds)

        def py_round():
            if args.api == "sync":
                return py.round_sync(args.seconds)
            return loop.run_until_complete(py.round(args.seconds))

        py_round()
        for _ in range(args.rounds):
            rows["rust client"].append(rust.round(args.seconds))
            rows["python binding"].append(py_round())
        rust.close()
        py.close()
    finally:
        a.kill()
        b.kill()
        etcd.stop()
    print(
        f"{args.blocks} blocks x {args.block_bytes} B per batch, concurrency "
        f"{args.concurrency}, {args.rounds} rounds of {args.seconds} s, tcp between two agents, "
        f"{args.api} Python calls"
    )
    print(f"{'':16} {'batches/s':>10} {'GB/s':>8}   (median; rounds)")
    med = {}
    for name, r in rows.items():
        med[name] = statistics.median(x[1] for x in r)
        print(
            f"{name:16} {statistics.median(x[0] for x in r):10.1f} {med[name]:8.3f}   "
            + ", ".join(f"{x[1]:.3f}" for x in r)
        )
    pairs = [p[1] / r[1] for p, r in zip(rows["python binding"], rows["rust client"], strict=True)]
    print(
        f"python / rust: {med['python binding'] / med['rust client']:.1%} of the medians; "
        f"{statistics.median(pairs):.1%} the median of adjacent rounds' ratios"
    )


if __name__ == "__main__":
    main()
