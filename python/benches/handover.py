"""Hand-over benchmark (issue 25 item 4): one request's KV pulled by a decode process from a
prefill process on the same device, through one kvfabric agent, by the connector's worker side
(``kvfabric.vllm.worker.Worker``) driven directly as python/tests/test_worker.py does, without
vLLM. The target: 4096 tokens of Llama-3-8B-shaped KV (512 MiB) in at most 1 ms on one H200.

    # here (CPU, small): from the repository root, the wheel installed in the venv
    KVFABRIC_BIN=$PWD/target/release/kvfabric python python/benches/handover.py \\
        --device cpu --layers 4 --tokens 512 --rounds 5
    # on the GPU machine (scripts/handover-gpu.sh builds target/gpu/ and prints these)
    python3 -m pip install -q --no-deps target/gpu/kvfabric-*.whl
    KVFABRIC_BIN=$PWD/target/gpu/kvfabric python3 python/benches/handover.py --json

The KV is laid out as vLLM lays out FlashAttention's (NHD) cache: one allocation for all layers,
``[layers, blocks, block tokens, KV heads, 2 * head size]``, each layer a ``[blocks, heads,
tokens, 2 * head size]`` view (token-major, LBNHC). Both sides have more blocks than the
request uses (prefill 1.25x, decode 1.5x) and the request's blocks sit at random, distinct ids
on both sides. The prefill fills its cache with seeded random bytes, registers it, holds the
request's blocks in its mailbox (a new slot and nonce per round, the last hold released) and
sends the decode a Handover over a pipe. The decode registers its cache once, then per round
zeroes it, and times ``start_load_kv`` of all the request's blocks (no prefix hit) until
``transfer_results`` reports it done (polled without sleeping; on CUDA a synchronize of the
decode's device before the clock stops). Every round is verified byte for byte against the
prefill's bytes, made again in the decode from the same seed on the same device; after the
rounds, the decode's other blocks must still be zero and the worker's stats must count exactly
the bytes moved. Any mismatch or failed pull exits non-zero (``--test-corrupt`` flips one byte
after the last pull, to show that it does).

The bound, in the same run on the decode's device: one contiguous ``copy_`` of the same number
of bytes (synchronized, the same number of rounds), and for reference torch's own gather of the
same blocks (``index_select`` then ``index_copy_``: two passes over the bytes, in one process).

Not measured: how the params reach the decode (a router's hop; here a pipe, before the clock
starts), the scheduler side (matching, the acknowledgement that frees the prefill's blocks,
lease renewals), the wait for vLLM's next step to collect a finished pull (polled here), the
first pull's one-time costs (the plan, opening the prefill's CUDA IPC memory: the warm-up
rounds), pulls of several requests at once, and anything across GPUs or nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import logging
import multiprocessing as mp
import os
import platform
import pstats
import random
import secrets
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fabric import Agent  # noqa: E402

import kvfabric  # noqa: E402
from kvfabric.vllm.layout import LayerSpec, fingerprint  # noqa: E402
from kvfabric.vllm.mailbox import Mailbox  # noqa: E402
from kvfabric.vllm.metadata import KVFabricMetadata, Load  # noqa: E402
from kvfabric.vllm.params import Handover, Segment  # noqa: E402
from kvfabric.vllm.plan import GroupBlocks  # noqa: E402
from kvfabric.vllm.settings import Settings  # noqa: E402
from kvfabric.vllm.worker import Worker, WorkerInfo  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # the GPU machine may not have it
    tqdm = None

ROWS = {
    "kvfabric": "kvfabric hand-over (2 processes)",
    "contiguous": "contiguous copy, same bytes (bound)",
    "gather": "torch gather + scatter, same blocks",
}


class BenchError(Exception):
    """A failed pull, a byte that differs, or a count that does not add up."""


@dataclass(frozen=True)
class Config:
    device: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    tokens: int
    dtype: str
    rounds: int
    warmup: int
    prefill_blocks: int
    decode_blocks: int
    remote_ids: tuple[int, ...]
    local_ids: tuple[int, ...]
    socket_dir: str
    seed: int
    slots: int
    test_corrupt: bool
    progress: bool
    profile: str | None = None

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def cell_bytes(self) -> int:
        """One (token, head) row: K then V."""
        return 2 * self.head_size * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.layers * self.tokens * self.kv_heads * self.cell_bytes


def layer_names(cfg: Config) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(cfg.layers)]


def cache(cfg: Config, blocks: int, seed: int | None) -> torch.Tensor:
    """All layers' KV in one allocation, as bytes ``[layers, blocks, tokens, heads, cell]``:
    seeded random bytes (every bit pattern, so NaNs too: compare bytes, never values), or
    zeros."""
    shape = (cfg.layers, blocks, cfg.block_size, cfg.kv_heads, cfg.cell_bytes)
    if seed is None:
        return torch.zeros(shape, dtype=torch.uint8, device=cfg.device)
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device=cfg.device)


def layer_views(cfg: Config, raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """What vLLM hands the connector per layer: ``[blocks, heads, tokens, 2 * head]``
    views of the one allocation, token-major (FlashAttention's NHD)."""
    typed = raw.view(cfg.torch_dtype)
    return {n: typed[i].permute(0, 2, 1, 3) for i, n in enumerate(layer_names(cfg))}


def worker(cfg: Config, name: str, blocks: int) -> Worker:
    spec = LayerSpec(0, cfg.block_size, (0, cfg.kv_heads), cfg.dtype)
    info = WorkerInfo(name, 0, 0, 1, blocks, cfg.block_size, {n: spec for n in layer_names(cfg)})
    return Worker(info, settings(cfg))


def settings(cfg: Config) -> Settings:
    # A CPU run of the full shape moves 512 MiB through memcpy: more than the default 10 s
    # would be a failure to report, not a pull to give up on.
    return Settings.of({"socket_dir": cfg.socket_dir, "load_timeout_s": 60})


def use_device(cfg: Config) -> Callable[[], None]:
    """Selects the device in this process; returns what waits for its queued work."""
    dev = torch.device(cfg.device)
    if dev.type != "cuda":
        return lambda: None
    if dev.index is not None:
        torch.cuda.set_device(dev)
    return lambda: torch.cuda.synchronize(dev)


# -- the prefill process --------------------------------------------------------------------


def prefill_main(cfg: Config, decode: Connection) -> None:
    """Holds the request's blocks and hands them over, once per round the decode asks for."""
    use_device(cfg)
    raw = cache(cfg, cfg.prefill_blocks, cfg.seed)
    p = worker(cfg, "p", cfg.prefill_blocks)
    mailbox = Mailbox(kvfabric.Client(cfg.socket_dir), "p.mailbox", cfg.slots, settings(cfg))
    try:
        # ``views``: on CPU the storage moves into kvfabric's memory, and ``raw`` with it.
        p.register_kv_caches(layer_views(cfg, raw), views=(raw,))
        layout_id = fingerprint([p.handshake().layout])
        held: int | None = None
        while (r := decode.recv()) is not None:
            # The decode is done with the last hold (it reported the pull): end it, as the
            # scheduler does on the decode's acknowledgement, and hold anew.
            if held is not None:
                mailbox.release(held)
            held, nonce = r % cfg.slots, secrets.randbits(63) | 1
            mailbox.hold(held, nonce)
            lease_s = 30.0
            decode.send(
                Handover(
                    engine="p",
                    request=f"req-{r}",
                    workers=(Segment(p.kv_name, p.kv_key),),
                    layouts=(p.layout,),
                    layout_id=layout_id,
                    mailbox=mailbox.segment,
                    slots=mailbox.slots,
                    slot=held,
                    nonce=nonce,
                    lease_s=lease_s,
                    expires_at=time.time() + lease_s,
                    tokens=cfg.tokens,
                    block_ids=(cfg.remote_ids,),
                )
            )
        if held is not None:
            mailbox.release(held)
    finally:
        p.shutdown()
        mailbox.close()


# -- the decode process ---------------------------------------------------------------------


def decode_main(cfg: Config, prefill: Connection, out: Connection) -> None:
    try:
        if cfg.profile:
            # Where the decode process spends the rounds (Python's view; the agent's is its log).
            prof = cProfile.Profile()
            result = prof.runcall(decode_rounds, cfg, prefill)
            with open(cfg.profile, "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
            out.send(result)
        else:
            out.send(decode_rounds(cfg, prefill))
    except Exception as e:  # noqa: BLE001 - the parent reports it and exits non-zero
        out.send({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
    finally:
        # The prefill may be gone already (it stops at the first None, or failed).
        with contextlib.suppress(OSError):
            prefill.send(None)


def check(
    raw: torch.Tensor, lid: torch.Tensor, expected: torch.Tensor, cfg: Config, r: int
) -> None:
    got = raw.index_select(1, lid)
    if torch.equal(got, expected):
        return
    diff = (got != expected).nonzero()
    layer, pos = int(diff[0, 0]), int(diff[0, 1])
    raise BenchError(
        f"round {r}: {len(diff)} values differ from the prefill's; the first in layer {layer}, "
        f"decode block {cfg.local_ids[pos]} (prefill block {cfg.remote_ids[pos]})"
    )


class Parts(logging.Handler):
    """The worker's own account of each pull (its "pulled" log line): the block-table reads,
    then the hold check, in ms."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.read: list[float] = []
        self.check: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("kvfabric: pulled") and len(record.args or ()) >= 6:
            args = record.args
            assert isinstance(args, tuple)
            self.read.append(float(args[4]))
            self.check.append(float(args[5]))


def timed(fn: Callable[[], Any], cfg: Config, sync: Callable[[], None]) -> list[float]:
    for _ in range(cfg.warmup):
        fn()
    sync()
    out = []
    for _ in range(cfg.rounds):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def decode_rounds(cfg: Config, prefill: Connection) -> dict[str, Any]:
    sync = use_device(cfg)
    dev = torch.device(cfg.device)
    raw = cache(cfg, cfg.decode_blocks, None)
    d = worker(cfg, "d", cfg.decode_blocks)
    parts = Parts()
    wlog = logging.getLogger("vllm.kvfabric")
    wlog.addHandler(parts)
    wlog.setLevel(logging.INFO)
    wlog.propagate = False
    try:
        d.register_kv_caches(layer_views(cfg, raw), views=(raw,))
        # The same generator on the same device makes the same bytes the prefill holds.
        source = cache(cfg, cfg.prefill_blocks, cfg.seed)
        lid = torch.tensor(cfg.local_ids, dtype=torch.long, device=dev)
        rid = torch.tensor(cfg.remote_ids, dtype=torch.long, device=dev)
        expected = source.index_select(1, rid)
        assert expected.numel() == cfg.nbytes
        positions = tuple(range(cfg.blocks))
        total = cfg.warmup + cfg.rounds
        bar = tqdm(total=total, desc="hand-over", unit="round") if tqdm and cfg.progress else None
        times: list[float] = []
        for r in range(total):
            prefill.send(r)
            h: Handover = prefill.recv()
            raw.zero_()
            group = GroupBlocks(positions, cfg.local_ids, h.block_ids[0], 0, h.tokens)
            meta = KVFabricMetadata(loads={h.request: Load(h, (group,))})
            sync()
            t0 = time.perf_counter()
            d.start_load_kv(meta)
            while True:
                _, done, failed = d.transfer_results()
                if done:
                    break
            sync()
            elapsed = time.perf_counter() - t0
            if failed:
                stats = d.get_stats()
                why = stats.data["failures"] if stats else {}
                raise BenchError(f"round {r}: the pull failed: {why}")
            if cfg.test_corrupt and r == total - 1:
                # Flips the last byte of the last destination block: the check must catch it.
                raw[-1, cfg.local_ids[-1]].view(-1)[-1:].bitwise_xor_(1)
            check(raw, lid, expected, cfg, r)
            if r >= cfg.warmup:
                times.append(elapsed)
            else:
                parts.read.clear()
                parts.check.clear()
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        prefill.send(None)
        others = torch.ones(cfg.decode_blocks, dtype=torch.bool, device=dev)
        others[lid] = False
        if bool(raw[:, others].any()):
            raise BenchError("bytes were written outside the request's blocks")
        stats = d.get_stats()
        moved = stats.data["bytes"] if stats else 0
        if stats is None or stats.data["loads"] != total or moved != total * cfg.nbytes:
            raise BenchError(f"the worker counts {moved} bytes moved, not {total * cfg.nbytes}")
        # The bound, and torch's own gather of the same blocks (verified too).
        dst = torch.empty_like(expected)
        contiguous = timed(lambda: dst.copy_(expected), cfg, sync)
        gather = timed(lambda: raw.index_copy_(1, lid, source.index_select(1, rid)), cfg, sync)
        check(raw, lid, expected, cfg, total)
    finally:
        d.shutdown()
    return {
        "device": device_name(dev),
        "kvfabric": times,
        "contiguous": contiguous,
        "gather": gather,
        "parts_ms": {"read": parts.read, "check": parts.check},
    }


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


# -- the parent ------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(cfg: Config, result: dict[str, Any]) -> dict[str, Any]:
    bound = statistics.median(result["contiguous"])
    rows = {}
    for key, label in ROWS.items():
        xs = result[key]
        p50 = statistics.median(xs)
        rows[key] = {
            "label": label,
            "p50_ms": p50 * 1e3,
            "p99_ms": pct(xs, 0.99) * 1e3,
            "gbps_p50": cfg.nbytes / p50 / 1e9,
            "vs_bound": p50 / bound,
            "ms": [x * 1e3 for x in xs],
        }
    return {
        "device": result["device"],
        "shape": {
            "layers": cfg.layers,
            "kv_heads": cfg.kv_heads,
            "head_size": cfg.head_size,
            "dtype": cfg.dtype,
            "block_size": cfg.block_size,
            "tokens": cfg.tokens,
            "bytes": cfg.nbytes,
            "prefill_blocks": cfg.prefill_blocks,
            "decode_blocks": cfg.decode_blocks,
        },
        "rounds": cfg.rounds,
        "warmup": cfg.warmup,
        "verified": True,
        "rows": rows,
        "parts_p50_ms": {
            k: statistics.median(v) if v else None for k, v in result["parts_ms"].items()
        },
    }


def print_table(s: dict[str, Any]) -> None:
    sh = s["shape"]
    print(
        f"\n{sh['layers']} layers x {sh['kv_heads']} KV heads x {sh['head_size']}, "
        f"{sh['dtype']}, blocks of {sh['block_size']} tokens, {sh['tokens']} tokens: "
        f"{sh['bytes']} B ({sh['bytes'] / (1 << 20):.1f} MiB) at random block ids "
        f"({sh['prefill_blocks']} prefill / {sh['decode_blocks']} decode blocks); "
        f"{s['device']}; {s['rounds']} rounds after {s['warmup']} warm-up, every byte verified\n"
    )
    print("| | p50 ms | p99 ms | GB/s at p50 | p50 / bound |")
    print("|---|---:|---:|---:|---:|")
    for row in s["rows"].values():
        print(
            f"| {row['label']} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} | "
            f"{row['gbps_p50']:.1f} | {row['vs_bound']:.2f}x |"
        )
    parts = s["parts_p50_ms"]
    if parts["read"] is not None and parts["check"] is not None:
        rest = s["rows"]["kvfabric"]["p50_ms"] - parts["read"] - parts["check"]
        print(
            f"\nOf the hand-over, p50 (the worker's own account): block-table read "
            f"{parts['read']:.3f} ms (worker -> agent -> copy -> answer), hold check "
            f"{parts['check']:.3f} ms, the rest {rest:.3f} ms (plan, submit, completion poll)"
        )


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if cuda else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", help="a torch dtype's name")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prefill-blocks", type=int, help="default: 1.25x the request's blocks")
    ap.add_argument("--decode-blocks", type=int, help="default: 1.5x the request's blocks")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--agent-bin", help="the kvfabric binary (default: $KVFABRIC_BIN)")
    ap.add_argument("--json", action="store_true", help="print one JSON object, no table")
    ap.add_argument("--profile", help="write the decode process's cProfile (top 40) to this file")
    ap.add_argument("--agent-log", help="write the agent's log to this file at the end")
    ap.add_argument(
        "--test-corrupt",
        action="store_true",
        help="flip one destination byte after the last pull: the run must fail",
    )
    args = ap.parse_args()
    if args.tokens <= 0 or args.block_size <= 0 or args.tokens % args.block_size:
        ap.error("--tokens must be a positive multiple of --block-size")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        ap.error(f"--dtype {args.dtype}: not a torch dtype")
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be at least 1, --warmup at least 0")
    return args


def main() -> int:
    args = parse()
    if args.agent_bin:
        os.environ["KVFABRIC_BIN"] = args.agent_bin
    n = args.tokens // args.block_size
    pblocks = args.prefill_blocks or n + n // 4
    dblocks = args.decode_blocks or n + n // 2
    if pblocks < n or dblocks < n:
        print(f"both sides need at least the request's {n} blocks", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    agent = Agent("handover-agent")
    cfg = Config(
        device=args.device,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
        tokens=args.tokens,
        dtype=args.dtype,
        rounds=args.rounds,
        warmup=args.warmup,
        prefill_blocks=pblocks,
        decode_blocks=dblocks,
        # Distinct ids in random order on both sides: no run of blocks coalesces by luck.
        remote_ids=tuple(rng.sample(range(pblocks), n)),
        local_ids=tuple(rng.sample(range(dblocks), n)),
        socket_dir=agent.socket_dir,
        seed=args.seed,
        slots=16,
        test_corrupt=args.test_corrupt,
        progress=True,
        profile=args.profile,
    )
    # spawn: each process initialises CUDA itself (a forked CUDA context is unusable).
    ctx = mp.get_context("spawn")
    p_end, d_end = ctx.Pipe()
    results, results_w = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=prefill_main, args=(cfg, p_end), name="prefill"),
        ctx.Process(target=decode_main, args=(cfg, d_end, results_w), name="decode"),
    ]
    try:
        for proc in procs:
            proc.start()
        # Only the children hold these ends now: one dying is an EOF at the other.
        for end in (p_end, d_end, results_w):
            end.close()
        try:
            result = results.recv()
        except EOFError:
            result = {"error": "the decode process died"}
        for proc in procs:
            proc.join(60)
        if "error" not in result and procs[0].exitcode != 0:
            result = {"error": f"the prefill process exited with {procs[0].exitcode}"}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        log = agent.log()
        if args.agent_log:
            Path(args.agent_log).write_text(log)
        agent.kill()
        shutil.rmtree(agent.socket_dir, ignore_errors=True)
    if "error" in result:
        print(result.get("trace", ""), file=sys.stderr)
        print(f"handover bench FAILED: {result['error']}", file=sys.stderr)
        print(f"agent log (tail):\n{log[-2000:]}", file=sys.stderr)
        return 1
    s = summary(cfg, result)
    if args.json:
        print(json.dumps(s))
    else:
        print_table(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
