#!/usr/bin/env python3
# Copied from shared/tools/gpu_baselines.py (kvfabric steering repo, measured 2026-11-30) so it
# travels to the GPU machine with scripts/gpu-bench.sh; keep the two in step.
"""GPU0 -> GPU1 baselines for KV-block transfers, to run in the same job as `kvfabric bench`.

Prints one JSON object per line: {"baseline", "block_size", "blocks", "gbps"}.
  contiguous-copy : one cudaMemcpyPeer of the whole batch (the link's practical ceiling)
  per-block-copy  : one cudaMemcpyAsync per block (what a naive engine does)
  gather-scatter  : index_select -> one peer copy -> index_copy (the best a PyTorch user gets)
  nccl-per-block  : NCCL batch_isend_irecv, one op per block (what a NCCL-based connector does)
  nccl-contiguous : NCCL send/recv of the whole batch as one buffer
Needs two GPUs and PyTorch. Keep NCCL_NVLS_ENABLE=0 in the environment.
"""
import argparse, json, os, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def emit(name, size, blocks, nbytes, seconds):
    print(json.dumps({"baseline": name, "block_size": size, "blocks": blocks,
                      "gbps": round(nbytes / seconds / 1e9, 2)}), flush=True)

def timed(fn, iters):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters

def local(sizes, total, pool, iters):
    g0 = torch.empty(pool, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    g1 = torch.empty(pool, dtype=torch.uint8, device="cuda:1")
    for size in sizes:
        blocks = total // size
        n = pool // size
        v0, v1 = g0.view(n, size), g1.view(n, size)
        src = torch.randperm(n)[:blocks]; dst = torch.randperm(n)[:blocks]
        emit("contiguous-copy", size, blocks, blocks * size,
             timed(lambda: g1[:blocks * size].copy_(g0[:blocks * size], non_blocking=True), iters))
        s, d = src.tolist(), dst.tolist()
        def per_block():
            for a, b in zip(s, d): v1[b].copy_(v0[a], non_blocking=True)
        emit("per-block-copy", size, blocks, blocks * size, timed(per_block, max(1, iters // 4)))
        si, di = src.to("cuda:0"), dst.to("cuda:1")
        emit("gather-scatter", size, blocks, blocks * size,
             timed(lambda: v1.index_copy_(0, di, v0.index_select(0, si).to("cuda:1", non_blocking=True)), iters))

def nccl(rank, sizes, total, iters):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device(f"cuda:{rank}"))
    torch.cuda.set_device(rank)
    for size in sizes:
        blocks = total // size
        bufs = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(blocks)]
        def per_block():
            ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, b, 1 - rank) for b in bufs]
            for r in dist.batch_isend_irecv(ops): r.wait()
        dist.barrier(); sec = timed(per_block, max(1, iters // 4))
        if rank == 1: emit("nccl-per-block", size, blocks, blocks * size, sec)
        flat = torch.empty(blocks * size, dtype=torch.uint8, device="cuda")
        def whole():
            if rank == 0: dist.send(flat, 1)
            else: dist.recv(flat, 0)
        dist.barrier(); sec = timed(whole, iters)
        if rank == 1: emit("nccl-contiguous", size, blocks, blocks * size, sec)
    dist.destroy_process_group()

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4096,16384,65536,262144,1048576")
    p.add_argument("--total", type=int, default=512 << 20, help="bytes per batch")
    p.add_argument("--pool", type=int, default=8 << 30, help="bytes of each GPU's block pool")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--skip-nccl", action="store_true")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    local(sizes, a.total, a.pool, a.iters)
    if not a.skip_nccl:
        mp.spawn(nccl, args=(sizes, a.total, a.iters), nprocs=2)
