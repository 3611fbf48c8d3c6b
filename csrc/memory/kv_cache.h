// KVCache: a BlockPool plus the Region its blocks live in, laid out layer-major.
//
// Memory order (one "slot" = K and V of one block in one layer, block_nbytes bytes):
//
//   region: | layer 0                          | layer 1                          | ...
//           | block 0 | block 1 | ... | blk N-1 | block 0 | block 1 | ... | blk N-1 |
//   slot:   | K: block_size x heads x dim | V: block_size x heads x dim |
//
// so one layer of a run of consecutive blocks is one contiguous byte range: layer-wise
// streaming sends a whole run of a layer as one operation. geometry() says where each slot is
// (KVGeometry::layer_major, common/kv_geometry.h); nothing else computes an address.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "common/kv_geometry.h"
#include "memory/block_pool.h"
#include "memory/region.h"

namespace kvmove {

class KVCache {
public:
    KVCache(int64_t num_layers, int64_t num_blocks, int64_t block_nbytes, bool huge_pages,
            int device = -1, bool pin = false);
    KVCache(const KVCache&) = delete;
    KVCache& operator=(const KVCache&) = delete;

    BlockPool& pool() { return pool_; }
    Region& region() { return region_; }
    const Region& region() const { return region_; }
    const KVGeometry& geometry() const { return geometry_; }
    int64_t num_layers() const { return geometry_.num_layers(); }
    int64_t num_blocks() const { return geometry_.num_blocks(); }
    uint64_t block_nbytes() const { return geometry_.block_nbytes(); }
    // From the region's start to (layer, block).
    uint64_t offset(int64_t layer, BlockId block) const {
        return geometry_.address(layer, 0, block) - region_.addr();
    }

    // Byte ranges holding the given blocks of the given layers (all layers when nullopt), in
    // layer order then block order, with ranges that touch merged into one.
    std::vector<Descriptor> descriptors(const std::vector<BlockId>& ids,
                                        const std::optional<std::vector<int64_t>>& layers) const;

private:
    static uint64_t checked_nbytes(int64_t num_layers, int64_t num_blocks, int64_t block_nbytes);

    BlockPool pool_;
    Region region_;
    const KVGeometry geometry_;  // over region_
};

// memcpy, or an asynchronous cudaMemcpy when device memory is involved (a host path never
// needs CUDA): device copies are bracketed by sync_devices.
void copy_bytes(void* dst, const void* src, uint64_t nbytes, bool device);
// Waits for every stream of the devices a and b live on (nothing for host caches).
void sync_devices(const KVCache& a, const KVCache& b);

// Copies block src_ids[i] of src into block dst_ids[i] of dst, every layer (a storage tier in
// host memory is a KVCache). Both caches must have the same layers and block size; runs
// consecutive on both sides copy as one memcpy per layer.
void copy_blocks(const KVCache& src, const std::vector<BlockId>& src_ids, KVCache& dst,
                 const std::vector<BlockId>& dst_ids);

}  // namespace kvmove
