#!/usr/bin/env python3
"""Formats the JSON lines of scripts/cpu-bench.sh as one table: kvfabric rows against their bound
(the best raw variant of the tightest limit of the path, measured in the same run; a ratio above
100% is a ceiling bug of the bench and says so), the other limits beside it (tcp: hot streams or
the kernel's two copies in DRAM), the row's same-shape raw baseline where measured, plus iperf3
and UCX measured on the same path in the same job."""
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

def value(c):
    return f'{c["p50_us"]:.1f} µs' if c.get("p50_us") is not None else f'{c["gbps"]:.2f}'

head = ["path", "transport", "op", "block", "ops/batch", "GB/s", "p50 µs", "p99 µs", "bound", "ratio",
        "other bound", "same shape", "iperf3", "vs iperf3", "UCX", "vs UCX"]
out = [head]
bugs = []
for r in rows:
    if "peer" in r:
        continue
    bs = r["block_size"]
    blk = f"{bs >> 20} MiB" if bs >= 1 << 20 else f"{bs >> 10} KiB"
    lat = r.get("ceiling_p50_us") is not None
    bound = f'{r["ceiling_name"]} {value({"gbps": r["ceiling_gbps"], "p50_us": r.get("ceiling_p50_us")})}'
    ratio = f'{r["ratio"]*100:.0f}%'
    if r.get("ceiling_bug"):
        bugs.append(f'{r["path"]} {r["transport"]} {r["op"]} {blk}: {ratio} of {r["ceiling_name"]}')
        ratio += " CEILING BUG"
    same = r.get("same_shape")
    other = ", ".join(f'{c["name"]} {c["gbps"]:.2f} ({r["gbps"]/c["gbps"]*100:.0f}%)'
                      for c in r.get("other_bounds", []))
    ip = peers.get((r["path"], "iperf3", None)) if r["transport"] == "tcp" and not lat else None
    u = ucx(r["path"], bs) if r["transport"] == "tcp" and not lat else None
    out.append([r["path"], r["transport"], r["op"], blk, str(r["blocks_per_batch"]),
                f'{r["gbps"]:.2f}', f'{r["p50_us"]:.1f}', f'{r["p99_us"]:.1f}', bound, ratio, other,
                value(same) if same else "",
                f"{ip:.2f}" if ip else "", f'{r["gbps"]/ip*100:.0f}%' if ip else "",
                f"{u:.2f}" if u else "", f'{r["gbps"]/u:.1f}×' if u else ""])
w = [max(len(row[i]) for row in out) for i in range(len(head))]
for i, row in enumerate(out):
    print("| " + " | ".join(c.ljust(w[j]) for j, c in enumerate(row)) + " |")
    if i == 0:
        print("|" + "|".join("-" * (x + 2) for x in w) + "|")
for b in bugs:
    print(f"ceiling bug: {b} — the bound is not the limit of the path")
