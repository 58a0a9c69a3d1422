// kvfabric GPU kernels: the batched block copy of the cuda-ipc transport, and the fill and verify
// kernels the bench uses to make and check device pools without a trip through the host.
//
// Build: scripts/gen-ptx.sh (writes copy.ptx beside this file; the driver JITs it at load time).

#include <stdint.h>

// One entry of the device-side op list. The host splits ops so that an entry is either fully
// 16-byte aligned on both sides (vector path) or short / mutually misaligned (byte path).
struct KvfOp {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long len;
};

// The op list starts with this header; `next` is uploaded as 0 with the list itself, so a launch
// needs no separate reset.
struct KvfOpList {
    unsigned long long next;
    unsigned long long count;
    KvfOp ops[1];
};

#define KVF_UNROLL 4
// Batches this small travel as kernel parameters: no op-list upload before the launch.
#define KVF_INLINE_OPS 16

struct KvfInline {
    unsigned long long count;
    KvfOp ops[KVF_INLINE_OPS];
};

// `width` threads copy one op, this one starting at `first`. Streaming (.cs) accesses: every
// byte is touched once, so it should not displace the L2. Each thread keeps KVF_UNROLL 16-byte
// loads in flight.
__device__ __forceinline__ void kvf_copy_op(const KvfOp& op, unsigned first, unsigned width)
{
    if (((op.src | op.dst | op.len) & 15ULL) == 0) {
        const uint4* __restrict__ s = reinterpret_cast<const uint4*>(op.src);
        uint4* __restrict__ d = reinterpret_cast<uint4*>(op.dst);
        const unsigned long long n = op.len >> 4;
        for (unsigned long long base = first; base < n; base += (unsigned long long)width * KVF_UNROLL) {
            uint4 r[KVF_UNROLL];
#pragma unroll
            for (int k = 0; k < KVF_UNROLL; ++k) {
                const unsigned long long j = base + (unsigned long long)width * k;
                if (j < n) {
                    r[k] = __ldcs(s + j);
                }
            }
#pragma unroll
            for (int k = 0; k < KVF_UNROLL; ++k) {
                const unsigned long long j = base + (unsigned long long)width * k;
                if (j < n) {
                    __stcs(d + j, r[k]);
                }
            }
        }
    } else {
        const unsigned char* s = reinterpret_cast<const unsigned char*>(op.src);
        unsigned char* d = reinterpret_cast<unsigned char*>(op.dst);
        for (unsigned long long j = first; j < op.len; j += width) {
            d[j] = s[j];
        }
    }
}

// Copies `len` bytes with `width` threads, this one starting at `first`. When source and
// destination agree modulo 16: a bytewise head up to the boundary, then 16-byte vectors, then a
// bytewise tail; otherwise bytewise throughout (correct, slow; KV blocks never do this).
__device__ __forceinline__ void kvf_copy_span(unsigned long long src, unsigned long long dst,
                                              unsigned long long len, unsigned first,
                                              unsigned width)
{
    KvfOp op;
    if (((src ^ dst) & 15ULL) != 0 || len < 16) {
        op.src = src;
        op.dst = dst;
        op.len = len;
        kvf_copy_op(op, first, width);
        return;
    }
    const unsigned long long head = (16 - (src & 15ULL)) & 15ULL;
    const unsigned long long body = (len - head) & ~15ULL;
    const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
    unsigned char* d = reinterpret_cast<unsigned char*>(dst);
    for (unsigned long long j = first; j < head; j += width) {
        d[j] = s[j];
    }
    for (unsigned long long j = head + body + first; j < len; j += width) {
        d[j] = s[j];
    }
    op.src = src + head;
    op.dst = dst + head;
    op.len = body;
    kvf_copy_op(op, first, width);
}

// Warps take ops from the list dynamically (one atomicAdd per op), so long and short ops balance
// across the whole persistent grid.
extern "C" __global__ void __launch_bounds__(512) kvf_copy(KvfOpList* list)
{
    const unsigned lane = threadIdx.x & 31;
    const unsigned long long count = list->count;
    for (;;) {
        unsigned long long i = 0;
        if (lane == 0) {
            i = atomicAdd(&list->next, 1ULL);
        }
        i = __shfl_sync(0xffffffffu, i, 0);
        if (i >= count) {
            return;
        }
        kvf_copy_op(list->ops[i], lane, 32);
    }
}

// A block table on the device (table_list.rs builds it): planes and the block-id pairs they all
// share, so the host uploads ids, not op triples, and this kernel computes every address. Work
// item i is piece (i - first) % pieces of block (i - first) / pieces of the plane whose `first`
// is the last one not above i; a piece is at most `piece` bytes.
struct KvfPlane {
    unsigned long long local;          // device address of block 0, local side
    unsigned long long local_stride;
    unsigned long long remote;         // device address of block 0, remote side
    unsigned long long remote_stride;
    unsigned long long len;            // bytes per block
    unsigned long long pieces;         // work items per block
    unsigned long long first;          // the plane's first work item
    unsigned long long pad;
};

struct KvfTable {
    unsigned long long next;           // work counter, uploaded as 0
    unsigned long long items;
    unsigned long long planes;
    unsigned long long blocks;
    unsigned long long pull;           // nonzero: remote → local
    unsigned long long piece;
    unsigned long long pad[2];
    // then KvfPlane[planes], then one word per block: local id (low half), remote id (high)
};

extern "C" __global__ void __launch_bounds__(512) kvf_copy_table(KvfTable* table)
{
    const unsigned lane = threadIdx.x & 31;
    const KvfPlane* planes = reinterpret_cast<const KvfPlane*>(table + 1);
    const unsigned long long nplanes = table->planes;
    const unsigned long long* ids = reinterpret_cast<const unsigned long long*>(planes + nplanes);
    const unsigned long long items = table->items;
    const unsigned long long piece = table->piece;
    const bool pull = table->pull != 0;
    unsigned long long p = 0;
    for (;;) {
        unsigned long long i = 0;
        if (lane == 0) {
            i = atomicAdd(&table->next, 1ULL);
        }
        i = __shfl_sync(0xffffffffu, i, 0);
        if (i >= items) {
            return;
        }
        // A warp's items only grow, so its plane only moves forward.
        while (p + 1 < nplanes && i >= planes[p + 1].first) {
            ++p;
        }
        const KvfPlane& pl = planes[p];
        const unsigned long long k = i - pl.first;
        // One piece per block is the KV case: no 64-bit division then.
        const unsigned long long b = pl.pieces == 1 ? k : k / pl.pieces;
        const unsigned long long at = (k - b * pl.pieces) * piece;
        const unsigned long long left = pl.len - at;
        const unsigned long long n = left < piece ? left : piece;
        const unsigned long long id = ids[b];
        const unsigned long long local = pl.local + (id & 0xffffffffULL) * pl.local_stride + at;
        const unsigned long long remote = pl.remote + (id >> 32) * pl.remote_stride + at;
        if (pull) {
            kvf_copy_span(remote, local, n, lane, 32);
        } else {
            kvf_copy_span(local, remote, n, lane, 32);
        }
    }
}

// The doorbell: a one-CTA kernel that lingers on the GPU, polling a ring in pinned host memory for
// small batches, so a latency-bound op costs no kernel launch (a launch alone takes microseconds).
// Entries are written "LL"-style: every 8-byte word holds 4 bytes of data and, in its high half,
// the entry's sequence number + 1, so one read of the entry both finds it and validates every
// word (no separate head to poll first: one PCIe round trip less). The host writes the words,
// then the header word (the op count) last. The kernel copies the ops with all its threads,
// fences, and advances `tail`. After `idle_ns` without work it clears `state` and exits; the host
// relaunches it when it finds `state` clear and no launch of its own still pending (`started`).
#define KVF_RING 64
// Header word + 6 words (src, dst, len as 32-bit halves) per op.
#define KVF_ENTRY_WORDS (1 + 6 * KVF_INLINE_OPS)

struct KvfRing {
    unsigned long long stop;        // host: nonzero asks the kernel to exit
    unsigned long long host_pad[15];
    unsigned long long tail;        // kernel: entries finished
    unsigned long long state;       // kernel: 1 while it serves the ring
    unsigned long long started;     // kernel: the launch generation now (or last) running
    unsigned long long kernel_pad[13];
    unsigned long long entries[KVF_RING][128];
};

__device__ __forceinline__ unsigned long long kvf_now_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Small batches: CTA b copies op b with all its threads, straight from the parameters (one
// 16-byte access per thread covers a 4 KiB op in one round trip).
extern "C" __global__ void __launch_bounds__(512) kvf_copy_inline(const KvfInline p)
{
    if (blockIdx.x < p.count) {
        kvf_copy_op(p.ops[blockIdx.x], threadIdx.x, blockDim.x);
    }
}

extern "C" __global__ void __launch_bounds__(512)
kvf_doorbell(KvfRing* ring, unsigned long long idle_ns, unsigned long long generation)
{
    volatile KvfRing* r = ring;
    __shared__ unsigned int data[KVF_ENTRY_WORDS];
    __shared__ int cmd;  // ops in the entry found, or -1: leave
    const unsigned t = threadIdx.x;
    unsigned long long tail = r->tail;
    if (t == 0) {
        r->started = generation;
        r->state = 1;
        __threadfence_system();
    }
    for (;;) {
        const unsigned want = (unsigned)(tail + 1);
        const volatile unsigned long long* e = r->entries[tail % KVF_RING];
        // Warp 0 alone polls the header and the first five ops (one 256-byte read); the other
        // warps wait at the barrier.
        if (t < 32) {
            const unsigned long long since = kvf_now_ns();
            for (unsigned polls = 1;; ++polls) {
                const unsigned long long word = e[t];
                const unsigned long long header = __shfl_sync(0xffffffffu, word, 0);
                const unsigned n = (unsigned)header;
                const bool found = (unsigned)(header >> 32) == want && n <= KVF_INLINE_OPS;
                const bool valid = found && (t >= 1 + 6 * n || (unsigned)(word >> 32) == want);
                if (__all_sync(0xffffffffu, valid)) {
                    data[t] = (unsigned)word;
                    if (t == 0) {
                        cmd = (int)n;
                    }
                    break;
                }
                bool leave = false;
                if (t == 0 && polls % 64 == 0) {
                    if (r->stop != 0) {
                        r->state = 0;
                        leave = true;
                    } else if (kvf_now_ns() - since > idle_ns) {
                        // Dekker with the host: it writes the header, then reads state; we
                        // write state, then read the header. One of us sees the other.
                        r->state = 0;
                        __threadfence_system();
                        leave = (unsigned)(e[0] >> 32) != want;
                        if (!leave) {
                            r->state = 1;
                        }
                    }
                }
                if (__any_sync(0xffffffffu, leave)) {
                    if (t == 0) {
                        cmd = -1;
                    }
                    break;
                }
            }
        }
        __syncthreads();
        const int c = cmd;
        if (c < 0) {
            return;
        }
        const unsigned count = (unsigned)c;
        const unsigned words = 1 + 6 * count;
        if (words > 32) {
            // The rest of a longer entry. The header was written last, so this is there now;
            // the loop only guards against a torn read.
            const bool mine = t >= 32 && t < words;
            for (;;) {
                const unsigned long long word = mine ? e[t] : 0;
                if (__syncthreads_and(!mine || (unsigned)(word >> 32) == want)) {
                    if (mine) {
                        data[t] = (unsigned)word;
                    }
                    break;
                }
            }
        }
        __syncthreads();
        for (unsigned i = 0; i < count; ++i) {
            const unsigned* w = data + 1 + 6 * i;
            KvfOp op;
            op.src = (unsigned long long)w[0] | ((unsigned long long)w[1] << 32);
            op.dst = (unsigned long long)w[2] | ((unsigned long long)w[3] << 32);
            op.len = (unsigned long long)w[4] | ((unsigned long long)w[5] << 32);
            kvf_copy_op(op, t, blockDim.x);
        }
        // Every thread's copies are visible system-wide before the host hears of them.
        __threadfence_system();
        __syncthreads();
        tail += 1;
        if (t == 0) {
            r->tail = tail;
        }
    }
}

// The bench's block pattern: word `i` of block `b` under `seed`. A counter-based mix so any word
// can be produced (and checked) on its own. Mirrored in Rust by kvfabric_engine::cuda::pattern_word.
__device__ __forceinline__ unsigned long long kvf_word(unsigned long long seed,
                                                       unsigned long long b,
                                                       unsigned long long i)
{
    unsigned long long x = seed + b * 0x9E3779B97F4A7C15ULL + i * 0xD1B54A32D192ED03ULL;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

extern "C" __global__ void __launch_bounds__(512)
kvf_fill(unsigned long long* pool, unsigned long long words, unsigned long long words_per_block,
         unsigned long long seed)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long w = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         w < words; w += stride) {
        pool[w] = kvf_word(seed, w / words_per_block, w % words_per_block);
    }
}

// result[0]: words that differ; result[1]: lowest bad word index (starts at ~0).
// source_of[b] is the source block written into destination block b, or 0xffffffff for a block
// that must still hold its poison.
extern "C" __global__ void __launch_bounds__(512)
kvf_verify(const unsigned long long* pool, unsigned long long words,
           unsigned long long words_per_block, const unsigned int* source_of,
           unsigned long long source_seed, unsigned long long poison_seed,
           unsigned long long* result)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long bad = 0;
    unsigned long long first = ~0ULL;
    for (unsigned long long w = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         w < words; w += stride) {
        const unsigned long long b = w / words_per_block;
        const unsigned long long i = w % words_per_block;
        const unsigned int s = source_of[b];
        const unsigned long long want =
            s == 0xffffffffu ? kvf_word(poison_seed, b, i) : kvf_word(source_seed, s, i);
        if (pool[w] != want) {
            ++bad;
            if (w < first) {
                first = w;
            }
        }
    }
    if (bad != 0) {
        atomicAdd(&result[0], bad);
        atomicMin(&result[1], first);
    }
}
