"""Before/after table from `kvfabric bench --json` lines (scripts/before-after.sh).

Files are named <build>_<mode>_<round>.jsonl (build: before|after, mode: direct|agent); each row
is the median over rounds, with after/before.
"""

import json
import statistics
import sys
from pathlib import Path


def rows_of(out: Path) -> dict:
    rows: dict = {}
    for path in sorted(out.glob("*.jsonl")):
        build, mode, _ = path.stem.split("_")
        with path.open() as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                if (
                    "agent_median_gbps" in r
                ):  # --through-agent: one batch shape, via two agents
                    key = (
                        mode,
                        "agents",
                        "read",
                        r["block_size"],
                        r["blocks_per_batch"],
                    )
                    val = r["agent_median_gbps"]
                    ratio_key = (*key, "vs engine")
                    rows.setdefault(ratio_key, {}).setdefault(build, []).append(
                        (r["ratio"], r.get("verified"))
                    )
                else:
                    key = (
                        mode,
                        r["transport"],
                        r["op"],
                        r["block_size"],
                        r["blocks_per_batch"],
                    )
                    val = r["p50_us"] if r["blocks_per_batch"] == 1 else r["gbps"]
                rows.setdefault(key, {}).setdefault(build, []).append(
                    (val, r.get("verified"))
                )
    return rows


def main() -> None:
    rows = rows_of(Path(sys.argv[1]))
    print(
        f"{'mode':7} {'path':7} {'op':5} {'block':>7} {'unit':6} {'before':>9} {'after':>9}"
        f" {'after/before':>12}  verified"
    )
    for key in sorted(rows):
        mode, path, op, block, per_batch = key[:5]
        unit = "ratio" if len(key) > 5 else ("p50 µs" if per_batch == 1 else "GB/s")
        before = [v for v, _ in rows[key].get("before", [])]
        after = [v for v, _ in rows[key].get("after", [])]
        mb = statistics.median(before) if before else float("nan")
        ma = statistics.median(after) if after else float("nan")
        verified = all(bool(ok) for values in rows[key].values() for _, ok in values)
        print(
            f"{mode:7} {path:7} {op:5} {block:>7} {unit:6} {mb:9.3f} {ma:9.3f} {ma / mb:12.3f}"
            f"  {verified} (n={len(before)}/{len(after)})"
        )


if __name__ == "__main__":
    main()
