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
//
// A wrapped cache is an engine's memory seen through a geometry of its own (any planes, one
// segment per engine tensor): it owns no region and frees nothing; whoever wrapped it keeps
// the memory alive (kvmove.KVCache.wrap holds the tensors).
#pragma once

#include <cstdint>
#include <memory>
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
    // Wraps memory owned elsewhere: geometry's planes lie in segments (ConfigError if not),
    // all on `device` (-1: host).
    KVCache(KVGeometry geometry, std::vector<Descriptor> segments, int device);
    KVCache(const KVCache&) = delete;
    KVCache& operator=(const KVCache&) = delete;

    BlockPool& pool() { return pool_; }
    // The owned region; ConfigError for a wrapped cache.
    Region& region();
    const Region& region() const;
    bool wrapped() const { return region_ == nullptr; }
    // The spans of memory the planes lie in (the region, or each wrapped tensor).
    const std::vector<Descriptor>& segments() const { return segments_; }
    int device() const { return device_; }  // -1: host memory
    bool on_device() const { return device_ >= 0; }
    const KVGeometry& geometry() const { return geometry_; }
    int64_t num_layers() const { return geometry_.num_layers(); }
    int64_t num_blocks() const { return geometry_.num_blocks(); }
    uint64_t block_nbytes() const { return geometry_.block_nbytes(); }
    // From the region's start to (layer, block).
    uint64_t offset(int64_t layer, BlockId block) const {
        return geometry_.address(layer, 0, block) - region().addr();
    }

    // Byte ranges holding the given blocks of the given layers (all layers when nullopt), in
    // layer order then block order, with ranges that touch merged into one.
    std::vector<Descriptor> descriptors(const std::vector<BlockId>& ids,
                                        const std::optional<std::vector<int64_t>>& layers) const;

private:
    static uint64_t checked_nbytes(int64_t num_layers, int64_t num_blocks, int64_t block_nbytes);

    BlockPool pool_;
    std::unique_ptr<Region> region_;  // null when wrapped
    const KVGeometry geometry_;       // over region_ or the wrapped memory
    const std::vector<Descriptor> segments_;
    const int device_;
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
