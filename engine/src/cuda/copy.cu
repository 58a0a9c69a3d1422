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

// One warp copies one op. Streaming (.cs) accesses: every byte is touched once, so it should not
// displace the L2. Each lane keeps KVF_UNROLL 16-byte loads in flight.
__device__ __forceinline__ void kvf_copy_one(const KvfOp& op, unsigned lane)
{
    if (((op.src | op.dst | op.len) & 15ULL) == 0) {
        const uint4* __restrict__ s = reinterpret_cast<const uint4*>(op.src);
        uint4* __restrict__ d = reinterpret_cast<uint4*>(op.dst);
        const unsigned long long n = op.len >> 4;
        for (unsigned long long base = lane; base < n; base += 32 * KVF_UNROLL) {
            uint4 r[KVF_UNROLL];
#pragma unroll
            for (int k = 0; k < KVF_UNROLL; ++k) {
                const unsigned long long j = base + 32ULL * k;
                if (j < n) {
                    r[k] = __ldcs(s + j);
                }
            }
#pragma unroll
            for (int k = 0; k < KVF_UNROLL; ++k) {
                const unsigned long long j = base + 32ULL * k;
                if (j < n) {
                    __stcs(d + j, r[k]);
                }
            }
        }
    } else {
        const unsigned char* s = reinterpret_cast<const unsigned char*>(op.src);
        unsigned char* d = reinterpret_cast<unsigned char*>(op.dst);
        for (unsigned long long j = lane; j < op.len; j += 32) {
            d[j] = s[j];
        }
    }
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
        kvf_copy_one(list->ops[i], lane);
    }
}

// Small batches: warp w copies op w, straight from the parameters.
extern "C" __global__ void __launch_bounds__(512) kvf_copy_inline(const KvfInline p)
{
    const unsigned long long warp = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (warp < p.count) {
        kvf_copy_one(p.ops[warp], threadIdx.x & 31);
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
