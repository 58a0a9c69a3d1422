"""KV transfer time per request, prefill finished → decode's blocks loaded, for prompts of
512 and 4096 tokens of the tiny test model: kvfabric (two agents, etcd, tcp) against vLLM's own
ExampleConnector (KV through files on local disk), in the same run.

    python python/benches/vllm_transfer.py [--requests 5]

"Prefill finished" is when the router has the prefill instance's answer; "loaded" is when the
decode side's connector finished the load (both connectors log it; same clock). NixlConnector
is not measured: the nixl wheels on PyPI are CUDA builds and this machine has no GPU.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from fabric import Agent, Etcd  # noqa: E402
from tiny_llama import write  # noqa: E402
from vllm_server import VllmServer, prefill  # noqa: E402


def done_times(log: str, pattern: str) -> list[tuple[float, float]]:
    """(done at, the connector's own load time in ms) of each load logged."""
    found = re.findall(pattern + r".* in ([0-9.]+) ms \(done at ([0-9.]+)\)", log)
    return [(float(at), float(ms)) for ms, at in found]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvfabric-bench-"))
    model = write(root / "model")
    etcd = Etcd()
    agents = [Agent(f"bench-{s}", etcd=etcd.endpoint, extra=["--transports", "tcp"]) for s in "pd"]
    storage = root / "example-kv"
    servers = {
        "kvfabric": (
            VllmServer("kvf-prefill", model, root, "kv_producer", agents[0].socket_dir),
            VllmServer(
                "kvf-decode", model, root, "kv_consumer", agents[1].socket_dir, prefix_caching=False
            ),
        ),
        "example": tuple(
            VllmServer(
                f"ex-{side}",
                model,
                root,
                role,
                connector=(
                    "TimedExampleConnector",
                    "timed_example_connector",
                    {"shared_storage_path": str(storage)},
                ),
                prefix_caching=False,
                pythonpath=str(HERE),
            )
            for side, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        ),
    }
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    fails = {"kvfabric": 0, "example": 0}
    try:
        for p, d in servers.values():
            p.wait_ready()
            d.wait_ready()
        rng = np.random.default_rng(0)
        for n in args.lengths:
            for name, (p, d) in servers.items():
                pattern = "kvfabric: pulled" if name == "kvfabric" else "example: loaded"
                times = []
                for i in range(args.requests + 1):  # the first warms up
                    prompt = rng.integers(3, 500, n).tolist()
                    seen = len(done_times(d.log(), pattern))
                    if name == "kvfabric":
                        params = prefill(p, prompt)
                    else:
                        p.complete(prompt, 1)
                        params = None
                    finished = time.time()
                    d.complete(prompt, 1, params)
                    deadline = time.monotonic() + 30
                    failed = False
                    while len(got := done_times(d.log(), pattern)) <= seen:
                        if d.log().count("failed, vLLM recomputes") > fails[name]:
                            fails[name] += 1
                            failed = True
                            break
                        if time.monotonic() > deadline:
                            raise SystemExit(f"{name}: no load logged for a {n}-token prompt")
                        time.sleep(0.05)
                    if failed:
                        continue
                    if i:
                        times.append(((got[seen][0] - finished) * 1e3, got[seen][1]))
                results[(name, n)] = times
    finally:
        for pair in servers.values():
            for s in pair:
                s.stop()
        for a in agents:
            a.kill()
        etcd.stop()
    print(
        f"KV transfer per request, prefill finished -> decode's blocks loaded (ms), "
        f"{args.requests} requests each, tiny Llama (2 layers, 2 KV heads x 32, fp32, "
        f"block 32)"
    )
    print(
        "median; in brackets the connector's own load (kvfabric: the pull through the agents; "
        "ExampleConnector: reading its files)"
    )
    print(f"{'prompt tokens':>14} {'KV bytes':>10} {'kvfabric':>18} {'ExampleConnector':>18}")
    for n in args.lengths:
        kv_bytes = -(-n // 32) * 32 * 2 * 2 * 2 * 32 * 4
        cells = []
        for c in ("kvfabric", "example"):
            r = results[(c, n)]
            e2e = statistics.median(x[0] for x in r)
            own = statistics.median(x[1] for x in r)
            cells.append(f"{e2e:.1f} ({own:.1f})")
        print(f"{n:>14} {kv_bytes:>10} {cells[0]:>18} {cells[1]:>18}")
    print(f"failed loads (recomputed, not timed): {fails}")


if __name__ == "__main__":
    main()
