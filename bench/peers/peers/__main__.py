"""python -m peers {run,serve,drive} — see scripts/peer-bench.sh, which runs `run`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from . import runner, sides
from .drivers import NAMES
from .engine import Link
from .errors import PeerError, config

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def size(text: str) -> int:
    """16K, 64KiB, 1M, 1GiB, 4096."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a size (e.g. 64K, 1GiB)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def sizes(text: str) -> list[int]:
    return [size(x) for x in text.split(",") if x.strip()]


def words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _link_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, choices=NAMES)
    p.add_argument("--transport", required=True, choices=("tcp", "shm", "ipc"))
    p.add_argument("--host", required=True, help="this side's address")
    p.add_argument("--device", type=int, help="GPU for the pool (default: host memory)")


def _work_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=sizes, default=sizes("16K,64K,1M"))
    p.add_argument("--ops", type=words, default=["read", "write"])
    p.add_argument("--pool-bytes", type=size, default=size("1GiB"))
    p.add_argument("--batch-bytes", type=size, default=size("64MiB"))
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--seconds", type=float, default=6.0, help="timed seconds per row (3 runs)")
    p.add_argument("--latency", action="store_true", help="add one 4 KiB read, one op in flight")
    p.add_argument("--latency-only", action="store_true", help="only the one-op 4 KiB read")
    p.add_argument("--no-progress", action="store_true")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="peers", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="the target side of one peer")
    _link_args(serve)
    drive = sub.add_parser("drive", help="the initiator side of one peer: one JSON line a row")
    _link_args(drive)
    drive.add_argument("--connect", required=True, help="the target's control address")
    drive.add_argument("--path", default="loopback", help="label for the rows")
    _work_args(drive)
    run = sub.add_parser("run", help="kvfabric and the peers over each path; the table last")
    run.add_argument("--kvfabric", help="kvfabric binary (none: peers only)")
    run.add_argument("--engines", type=words, default=["kvfabric", *NAMES])
    run.add_argument("--paths", type=words, default=["loopback", "veth", "shm"])
    run.add_argument(
        "--netns",
        type=words,
        default=["kvfpA", "kvfpB"],
        help="initiator,target namespaces of the veth path",
    )
    run.add_argument("--veth-ips", type=words, default=["10.79.0.1", "10.79.0.2"])
    run.add_argument("--device", type=int, help="GPU for the ipc and gpu-tcp paths")
    run.add_argument("--out", type=Path, default=Path("target/peer-bench"))
    run.add_argument(
        "--nixl-plugin-dir",
        type=Path,
        help="directory holding libplugin_KVFABRIC.so (the nixl-kvfabric engine)",
    )
    _work_args(run)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "serve":
            token = os.environ.get("KVF_PEERS_TOKEN", "")
            if len(token) < 16:
                raise config("KVF_PEERS_TOKEN", "…", "must hold the run's token (16+ characters)")
            sides.serve(a.engine, Link(a.transport, a.host, a.device), token)
            return 0
        plan = runner.Plan(
            [] if a.latency_only else a.blocks,
            a.ops,
            a.pool_bytes,
            a.batch_bytes,
            a.inflight,
            a.seconds,
            a.latency or a.latency_only,
        )
        for shape in plan.shapes():
            shape.validate()
        if a.cmd == "drive":
            failed = sides.drive(
                a.engine,
                Link(a.transport, a.host, a.device),
                a.connect,
                os.environ.get("KVF_PEERS_TOKEN", ""),
                plan.shapes(),
                a.path,
                not a.no_progress,
            )
            return 1 if failed else 0
        if len(a.netns) != 2 or len(a.veth_ips) != 2:
            raise config("netns/veth-ips", a.netns + a.veth_ips, "need two names and two addresses")
        paths = runner.path_specs(
            a.paths, (a.netns[0], a.netns[1]), (a.veth_ips[0], a.veth_ips[1]), a.device
        )
        runner.run(a.kvfabric, a.engines, paths, plan, a.out, not a.no_progress, a.nixl_plugin_dir)
        return 0
    except PeerError as e:
        print(f"peers: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
