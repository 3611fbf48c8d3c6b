#include "memory/kv_cache.h"

#include <climits>
#include <cstring>

#include "common/errors.h"
#include "cuda/cuda_memory.h"

namespace kvmove {

uint64_t KVCache::checked_nbytes(int64_t num_layers, int64_t num_blocks, int64_t block_nbytes) {
    KVMOVE_CHECK(num_layers > 0 && num_layers <= INT32_MAX, Config,
                 "num_layers must be in [1, " << INT32_MAX << "], got " << num_layers);
    KVMOVE_CHECK(num_blocks > 0 && num_blocks <= INT32_MAX, Config,
                 "num_blocks must be in [1, " << INT32_MAX << "], got " << num_blocks);
    KVMOVE_CHECK(block_nbytes > 0, Config, "block_nbytes must be positive, got " << block_nbytes);
    uint64_t total = 0;
    bool overflow = __builtin_mul_overflow(static_cast<uint64_t>(num_layers),
                                           static_cast<uint64_t>(num_blocks), &total) ||
                    __builtin_mul_overflow(total, static_cast<uint64_t>(block_nbytes), &total);
    KVMOVE_CHECK(!overflow, Config,
                 num_layers << " layers x " << num_blocks << " blocks x " << block_nbytes
                            << " bytes overflows 64 bits");
    return total;
}

KVCache::KVCache(int64_t num_layers, int64_t num_blocks, int64_t block_nbytes, bool huge_pages,
                 int device, bool pin)
    : pool_(num_blocks),
      region_(std::make_unique<Region>(checked_nbytes(num_layers, num_blocks, block_nbytes),
                                       huge_pages, device, pin)),
      geometry_(KVGeometry::layer_major(region_->addr(), num_layers, num_blocks,
                                        static_cast<uint64_t>(block_nbytes))),
      segments_{{region_->addr(), region_->nbytes()}},
      device_(region_->device()) {}

KVCache::KVCache(KVGeometry geometry, std::vector<Descriptor> segments, int device)
    : pool_(geometry.num_blocks()),
      geometry_(std::move(geometry)),
      segments_(std::move(segments)),
      device_(device) {
    KVMOVE_CHECK(!segments_.empty(), Config, "a wrapped cache needs at least one segment");
    const std::string outside = outside_segments(geometry_, segments_);
    KVMOVE_CHECK(outside.empty(), Config, "wrapped memory: " << outside);
}

Region& KVCache::region() {
    KVMOVE_CHECK(region_ != nullptr, Config, "a wrapped cache has no region: the engine owns it");
    return *region_;
}

const Region& KVCache::region() const {
    KVMOVE_CHECK(region_ != nullptr, Config, "a wrapped cache has no region: the engine owns it");
    return *region_;
}

std::vector<Descriptor> KVCache::descriptors(
    const std::vector<BlockId>& ids, const std::optional<std::vector<int64_t>>& layers) const {
    geometry_.check_ids(ids, "");
    return geometry_.descriptors(ids, geometry_.layers_or_all(layers));
}

void copy_bytes(void* dst, const void* src, uint64_t nbytes, bool device) {  // see kv_cache.h
    if (device) {
        cuda_copy(dst, src, nbytes);
    } else {
        std::memcpy(dst, src, nbytes);
    }
}

void sync_devices(const KVCache& a, const KVCache& b) {
    for (const KVCache* cache : {&a, &b}) {
        if (cache->on_device()) {
            cuda_synchronize(cache->device());
        }
    }
}

void copy_blocks(const KVCache& src, const std::vector<BlockId>& src_ids, KVCache& dst,
                 const std::vector<BlockId>& dst_ids) {
    KVMOVE_CHECK(src_ids.size() == dst_ids.size(), Config,
                 "copy_blocks needs as many destination ids as source ids, got "
                     << dst_ids.size() << " for " << src_ids.size());
    std::string difference = copy_difference(src.geometry(), dst.geometry());
    KVMOVE_CHECK(difference.empty(), Config,
                 "copy_blocks needs caches of the same shape, got "
                     << src.num_layers() << " x " << src.block_nbytes() << " B and "
                     << dst.num_layers() << " x " << dst.block_nbytes()
                     << " B (layers x bytes per block and layer)");
    src.geometry().check_ids(src_ids, "source");
    dst.geometry().check_ids(dst_ids, "destination");
    const bool device = src.on_device() || dst.on_device();
    sync_devices(src, dst);  // what other streams wrote to either cache is there
    for (const RangePair& r : pair_ranges(src.geometry(), src_ids, dst.geometry(), dst_ids,
                                          src.geometry().layers_or_all(std::nullopt))) {
        copy_bytes(reinterpret_cast<void*>(r.there), reinterpret_cast<const void*>(r.here),
                   r.nbytes, device);
    }
    sync_devices(src, dst);  // and the copies are done when we return
}

}  // namespace kvmove
