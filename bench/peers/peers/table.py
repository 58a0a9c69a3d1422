"""The one table printed last: kvfabric and each peer on the same row, and kvfabric / peer."""

from __future__ import annotations

from typing import Any

from .drivers import NAMES


def size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _latency(r: dict[str, Any]) -> bool:
    return bool(r["blocks_per_batch"] == 1 and r["inflight"] == 1)


def _failed(r: dict[str, Any]) -> bool:
    return r.get("error") is not None or r.get("gbps") is None or r.get("p50_us") is None


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if _failed(r):
        return "failed"
    if _latency(r):
        text = f"{r['p50_us']:.1f}/{r['p99_us']:.1f} µs"
    else:
        text = f"{r['gbps']:.2f} ({r['p50_us'] / 1e3:.1f} ms)"
    return text if r.get("verified") else text + " UNVERIFIED"


def _ratio(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    ok = [r for r in (ours, theirs) if r is not None and not _failed(r)]
    if len(ok) < 2 or ours is None or theirs is None:
        return "-"
    if _latency(ours):
        return f"{ours['p50_us'] / theirs['p50_us']:.2f}×"
    return f"{ours['gbps'] / theirs['gbps']:.2f}×" if theirs["gbps"] else "-"


def render(rows: list[dict[str, Any]]) -> str:
    """Bandwidth cells: GB/s (batch p50); latency cells (one 4 KiB op): p50/p99. kvfabric/peer is
    GB/s over GB/s (higher is better), for latency p50 over p50 (lower is better)."""
    keys: list[tuple[str, str, int, bool]] = []
    by: dict[tuple[str, str, int, bool, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["path"], r["op"], r["block_size"], _latency(r))
        if key not in keys:
            keys.append(key)
        cell = (*key, str(r["engine"]))
        by[cell] = r
    engines = ["kvfabric", *[n for n in NAMES if any(r["engine"] == n for r in rows)]]
    head = ["path", "op", "block", "kvfabric"]
    for n in engines[1:]:
        head += [n, f"kvf/{n}"]
    # NIXL on kvfabric's backend against NIXL on its own UCX: the same NIXL calls.
    backends = "nixl" in engines and "nixl-kvfabric" in engines
    if backends:
        head.append("NIXL KVFABRIC/UCX")
    table = [head]
    for key in keys:
        path, op, block, lat = key
        ours = by.get((*key, "kvfabric"))
        line = [path, "read 1 op" if lat else op, size(block), _cell(ours)]
        for n in engines[1:]:
            theirs = by.get((*key, n))
            line += [_cell(theirs), _ratio(ours, theirs)]
        if backends:
            line.append(_ratio(by.get((*key, "nixl-kvfabric")), by.get((*key, "nixl"))))
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    out.insert(1, "  ".join("-" * w for w in widths))
    versions = sorted({f"{r['engine']} {r['version']}" for r in rows if r.get("version")})
    notes = [
        "GB/s (batch p50); one-op rows p50/p99; kvf/peer: GB/s ratio, or p50 ratio for one op"
        + ("; NIXL KVFABRIC/UCX: the same ratio between NIXL's two backends" if backends else ""),
        "versions: " + "; ".join(versions),
    ]
    failures = [
        f"  {r['engine']} {r['path']} {r['op']} {size(r['block_size'])}: {r.get('error')}"
        for r in rows
        if _failed(r)
    ]
    if failures:
        notes.append("failed rows:")
        notes += sorted(set(failures))
    return "\n".join([*out, "", *notes])
