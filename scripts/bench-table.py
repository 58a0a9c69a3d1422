#!/usr/bin/env python3
"""Formats the JSON lines of scripts/cpu-bench.sh as one table: kvfabric rows with their own
ceiling, plus iperf3 and UCX measured on the same path in the same job."""
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peers = {}
for r in rows:
    if "peer" in r:
        peers[(r["path"], r["peer"], r.get("block_size"))] = r["gbps"]

def ucx(path, bs):
    # Nearest measured UCX size at or below the block size.
    sizes = sorted(s for (p, n, s) in peers if p == path and n == "ucx-tcp-put_bw" and s and s <= bs)
    return peers.get((path, "ucx-tcp-put_bw", sizes[-1])) if sizes else None

head = ["path", "transport", "op", "block", "ops/batch", "GB/s", "p50 µs", "ceiling", "ratio",
        "iperf3", "vs iperf3", "UCX", "vs UCX"]
out = [head]
for r in rows:
    if "peer" in r:
        continue
    bs = r["block_size"]
    blk = f"{bs >> 20} MiB" if bs >= 1 << 20 else f"{bs >> 10} KiB"
    lat = r.get("ceiling_p50_us") is not None
    ceiling = f'{r["ceiling_name"]} {r["ceiling_p50_us"]:.1f} µs' if lat else f'{r["ceiling_name"]} {r["ceiling_gbps"]:.2f}'
    ip = peers.get((r["path"], "iperf3", None)) if r["transport"] == "tcp" and not lat else None
    u = ucx(r["path"], bs) if r["transport"] == "tcp" and not lat else None
    out.append([r["path"], r["transport"], r["op"], blk, str(r["blocks_per_batch"]),
                f'{r["gbps"]:.2f}', f'{r["p50_us"]:.1f}', ceiling, f'{r["ratio"]*100:.0f}%',
                f"{ip:.2f}" if ip else "", f'{r["gbps"]/ip*100:.0f}%' if ip else "",
                f"{u:.2f}" if u else "", f'{r["gbps"]/u:.1f}×' if u else ""])
w = [max(len(row[i]) for row in out) for i in range(len(head))]
for i, row in enumerate(out):
    print("| " + " | ".join(c.ljust(w[j]) for j, c in enumerate(row)) + " |")
    if i == 0:
        print("|" + "|".join("-" * (x + 2) for x in w) + "|")
