"""Serving benchmark: real vLLM prefill → decode with KVFabricConnector against NixlConnector, same
model, prompts and load, in one run.

    python python/benches/serving.py [--rounds 5] [--lengths 512 2048 4096] [--seconds 20]

Each connector gets its own pair of vLLM CPU servers (a prefill, ``kv_producer``, and a decode,
``kv_consumer``), started one connector after the other on the same machine, plus a server with
no connector for the prefill baseline. The model is a random-weight Llama of 8 layers × 8 KV
heads × 64 (fp32: 32 KiB of KV per token; blocks of 32 tokens = 1 MiB). A request is the
router's two calls: the prefill with ``do_remote_decode`` and ``max_tokens: 1``, then the decode
with the params it returned (``max_tokens: 1``: the decode's answer is its first token).
Prefix caching stays at vLLM's default (on); prompts are random, so nothing is a local hit.

Tables:
1. decode-request latency (router has the prefill's answer → decode's first token), p50/p99
   per prompt length, and how many prompts' KV was handed over: for kvfabric, a pull the
   decode logged as done; for NixlConnector, the decode's ``vllm:external_prefix_cache_hits``
   grew by the prompt length (which vLLM also counts for a load that then fails);
2. prefill time with each connector against the server with none (the connector's cost on
   compute);
3. kvfabric's pull inside vLLM (its log line): time and GB/s, against ``kvfabric bench`` moving
   the same bytes per batch (shm, 1 MiB blocks) in the same run;
4. load: N concurrent clients (1, 4, 16) for ``--seconds`` each, 512-token prompts: requests/s,
   decode-request latency p50/p99, failures, and the share of prompt tokens the decode took
   from the connector (100%: nothing recomputed).

NixlConnector: ``nixl`` and ``nixl-cu13`` 1.5.1 from PyPI (installed here with ``--no-deps`` if
missing), ``kv_buffer_device: cpu``, a side-channel port per instance. The kvfabric agent binary
must have the bench subcommand (``cargo build --release --bin kvfabric``, default features).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "tests"))
from fabric import Agent, kvfabric_bin  # noqa: E402
from tiny_llama import write  # noqa: E402
from vllm_server import (  # noqa: E402
    HITS,
    NICE,
    VllmServer,
    nixl_connector,
    prefill,
    prompt,
    start,
)

KV_PER_TOKEN = 8 * 8 * 64 * 2 * 4
KV_BYTES = 1536 << 20  # per server: 12 prompts of 4096 tokens


def ensure_nixl() -> None:
    try:
        # nixl._api, not nixl: from the repository root that finds the crate's folder.
        import nixl._api  # noqa: F401
    except ImportError:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "nixl==1.5.1",
             "nixl-cu13==1.5.1"],
            check=True,
        )  # fmt: skip


def servers(
    name: str, model: Path, root: Path, agent: Agent | None, nice: int
) -> dict[str, VllmServer]:
    """The prefill and decode of one connector (``agent`` None: NixlConnector)."""
    out = {}
    for side, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        if agent is not None:
            out[side] = VllmServer(
                f"{name}-{side}", model, root, role, agent.socket_dir, kv_bytes=KV_BYTES, nice=nice
            )
            continue
        out[side] = VllmServer(
            f"{name}-{side}", model, root, role, kv_bytes=KV_BYTES, nice=nice, **nixl_connector()
        )
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def request(pd: dict[str, VllmServer], n: int, seed: int) -> dict:
    """One router request: its prefill and decode times (ms) and the decode's request id."""
    p = prompt(n, seed)
    t0 = time.perf_counter()
    params = prefill(pd["prefill"], p)
    t1 = time.perf_counter()
    out = pd["decode"].complete(p, 1, params, timeout=300)
    t2 = time.perf_counter()
    return {"prefill_ms": (t1 - t0) * 1e3, "decode_ms": (t2 - t1) * 1e3, "id": out["id"]}


def latency(pd, lengths, rounds, bar) -> dict[int, dict]:
    out = {}
    for n in lengths:
        request(pd, n, 1)  # warm-up of this length
        rows, handed = [], 0
        for r in range(rounds):
            before = pd["decode"].metric(HITS)
            rows.append(request(pd, n, 100 * n + r))
            handed += pd["decode"].metric(HITS) - before == n
            bar.update()
        out[n] = {"rows": rows, "handed": handed}
    return out


def plain_prefill(server: VllmServer, lengths, rounds, bar) -> dict[int, list[float]]:
    out = {}
    for n in lengths:
        server.complete(prompt(n, 1), 1)
        times = []
        for r in range(rounds):
            p = prompt(n, 100 * n + r)
            t0 = time.perf_counter()
            server.complete(p, 1)
            times.append((time.perf_counter() - t0) * 1e3)
            bar.update()
        out[n] = times
    return out


def load(pd, clients: int, seconds: float, n: int = 512) -> dict:
    """``clients`` threads each sending requests back to back for ``seconds``."""
    lat, failures, done = [], 0, 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    before = pd["decode"].metric(HITS)

    def client(c: int) -> None:
        nonlocal failures, done
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:
                r = request(pd, n, 10_000_000 + 1000 * c + i)
                with lock:
                    lat.append(r["decode_ms"])
                    done += 1
            except Exception:  # noqa: BLE001 - counted
                with lock:
                    failures += 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.monotonic() - t0
    hits = pd["decode"].metric(HITS) - before
    return {
        "rps": done / wall,
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
        "failures": failures,
        # Prompt tokens the decode took from the connector, of all it was sent.
        "handed": hits / (done * n) if done else float("nan"),
        "done": done,
    }


def kvfabric_pulls(decode: VllmServer, ids: list[str]) -> dict[str, tuple[int, float]]:
    """(bytes, ms) of each kvfabric pull the decode logged, by response id."""
    found = {}
    # The engine's request id is the response's id, "-<index>-" and a suffix.
    line = r"kvfabric: pulled (\S+?)-\d+-[0-9a-f]+: (\d+) B from \S+ in ([0-9.]+) ms"
    for m in re.finditer(line, decode.log()):
        found[m.group(1)] = (int(m.group(2)), float(m.group(3)))
    return {i: found[i] for i in ids if i in found}


def bench_reference(lengths: list[int]) -> dict[int, float]:
    """``kvfabric bench`` GB/s on the same bytes per batch (shm, 1 MiB blocks, one at a time)."""
    out = {}
    for n in lengths:
        blocks = max(1, n * KV_PER_TOKEN >> 20)
        r = subprocess.run(
            [kvfabric_bin(), "bench", "--json", "--transport", "shm", "--op", "read",
             "--block-size", "1MiB", "--blocks-per-batch", str(blocks), "--pool-bytes", "1GiB",
             "--concurrency", "1", "--duration", "2", "--no-latency"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        out[n] = max(float(row.get("gbps", 0.0)) for row in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--connectors", nargs="+", default=["kvfabric", "nixl"])
    ap.add_argument("--json", type=Path, help="write every measurement here too")
    ap.add_argument(
        "--server-nice",
        type=int,
        default=NICE,
        help="every vLLM server's nice value, the agent's being 0: as a node gives the agent "
        "DaemonSet CPU of its own (on two cores, vLLM's workers spin between engine steps)",
    )
    args = ap.parse_args()
    if "nixl" in args.connectors:
        ensure_nixl()
    root = Path(tempfile.mkdtemp(prefix="kvfabric-serving-"))
    model = write(root / "model", seed=0, layers=8, kv_heads=8, head_dim=64)
    results: dict = {"lengths": args.lengths, "clients": args.clients, "seconds": args.seconds}
    steps = len(args.lengths) * args.rounds
    with tqdm(total=steps * (1 + len(args.connectors)), desc="serving bench", unit="req") as bar:
        plain = VllmServer("plain", model, root, kv_bytes=KV_BYTES, nice=args.server_nice)
        start(plain)
        try:
            results["plain"] = plain_prefill(plain, args.lengths, args.rounds, bar)
        finally:
            plain.stop()
        for name in args.connectors:
            agent = Agent("serving-agent") if name == "kvfabric" else None
            pd = servers(name, model, root, agent, args.server_nice)
            try:
                bar.set_postfix_str(f"{name}: starting")
                start(*pd.values())
                bar.set_postfix_str(f"{name}: latency")
                lat = latency(pd, args.lengths, args.rounds, bar)
                res = {"latency": lat}
                if name == "kvfabric":
                    ids = [r["id"] for n in args.lengths for r in lat[n]["rows"]]
                    res["pulls"] = kvfabric_pulls(pd["decode"], ids)
                    # A pull that failed is recomputed, though vLLM counted its tokens as
                    # external hits when it scheduled the load.
                    for n in args.lengths:
                        rows = lat[n]["rows"]
                        lat[n]["handed"] = sum(r["id"] in res["pulls"] for r in rows)
                res["load"] = {}
                for c in args.clients:
                    bar.set_postfix_str(f"{name}: {c} clients")
                    res["load"][c] = load(pd, c, args.seconds)
                results[name] = res
            finally:
                for s in pd.values():
                    s.stop()
                if agent is not None:
                    agent.kill()
    if "kvfabric" in args.connectors:
        results["bench"] = bench_reference(args.lengths)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    report(results, args.connectors)


def report(res: dict, connectors: list[str]) -> None:
    lengths = res["lengths"]
    names = {"kvfabric": "kvfabric", "nixl": "NixlConnector"}
    print("\n## Decode-request latency (ms; router has the prefill's answer -> first token)\n")
    head = " | ".join(f"{names[c]} p50 / p99 (handed over)" for c in connectors)
    ratio = len(connectors) == 2
    print(f"| prompt tokens | KV | {head} |" + (" p50 ratio |" if ratio else ""))
    print("|---:|---:|" + "---|" * len(connectors) + ("---:|" if ratio else ""))
    for n in lengths:
        cells, p50s = [], []
        for c in connectors:
            lat = res[c]["latency"][n]
            d = [r["decode_ms"] for r in lat["rows"]]
            p50s.append(statistics.median(d))
            cells.append(f"{p50s[-1]:.0f} / {pct(d, 0.99):.0f} ({lat['handed']}/{len(d)})")
        extra = f" {p50s[0] / p50s[1]:.2f} |" if ratio else ""
        print(f"| {n} | {n * KV_PER_TOKEN >> 20} MiB | " + " | ".join(cells) + " |" + extra)
    print("\n## Prefill time (ms, p50) against the same server with no connector\n")
    print("| prompt tokens | no connector | " + " | ".join(names[c] for c in connectors) + " |")
    print("|---:|---:|" + "---:|" * len(connectors))
    for n in lengths:
        base = statistics.median(res["plain"][n])
        cells = []
        for c in connectors:
            p = statistics.median(r["prefill_ms"] for r in res[c]["latency"][n]["rows"])
            cells.append(f"{p:.0f} ({(p / base - 1) * 100:+.0f}%)")
        print(f"| {n} | {base:.0f} | " + " | ".join(cells) + " |")
    if "kvfabric" in connectors:
        print("\n## kvfabric's pull inside vLLM against `kvfabric bench` on the same bytes\n")
        print("| prompt tokens | pulls | pull ms p50 / p99 | GB/s p50 | bench GB/s | ratio |")
        print("|---:|---:|---:|---:|---:|---:|")
        pulls = res["kvfabric"]["pulls"]
        for n in lengths:
            mine = [
                pulls[r["id"]] for r in res["kvfabric"]["latency"][n]["rows"] if r["id"] in pulls
            ]
            ms = [m for _, m in mine]
            gbps = statistics.median(b / m / 1e6 for b, m in mine) if mine else float("nan")
            bench = res["bench"][n]
            print(
                f"| {n} | {len(mine)} | {pct(ms, 0.5):.1f} / {pct(ms, 0.99):.1f} | {gbps:.2f} | "
                f"{bench:.2f} | {gbps / bench * 100:.0f}% |"
            )
    print(f"\n## Load: concurrent clients, 512-token prompts, {res['seconds']:.0f} s each\n")
    print("| clients | " + " | ".join(
        f"{names[c]} req/s, p50 / p99 ms, failed, KV handed over" for c in connectors
    ) + " |" + (" req/s ratio |" if ratio else ""))  # fmt: skip
    print("|---:|" + "---|" * len(connectors) + ("---:|" if ratio else ""))
    for k in res["clients"]:
        cells = []
        for c in connectors:
            x = res[c]["load"][k]
            cells.append(
                f"{x['rps']:.2f}, {x['p50']:.0f} / {x['p99']:.0f}, {x['failures']}, "
                f"{x['handed'] * 100:.0f}%"
            )
        extra = ""
        if ratio:
            a, b = (res[c]["load"][k]["rps"] for c in connectors)
            extra = f" {a / b:.2f} |" if b else " inf |"
        print(f"| {k} | " + " | ".join(cells) + " |" + extra)


if __name__ == "__main__":
    os.environ.setdefault("TQDM_MININTERVAL", "1")
    main()
