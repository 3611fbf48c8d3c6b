#include "memory/kv_cache.h"

#include <climits>
#include <cstring>

#include "cuda/cuda_memory.h"
#include "common/errors.h"

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
    : num_layers_(num_layers),
      block_nbytes_(static_cast<uint64_t>(block_nbytes)),
      pool_(num_blocks),
      region_(checked_nbytes(num_layers, num_blocks, block_nbytes), huge_pages, device, pin) {}

uint64_t KVCache::offset(int64_t layer, BlockId block) const {
    return (static_cast<uint64_t>(layer) * num_blocks() + block) * block_nbytes_;
}

std::vector<Descriptor> KVCache::descriptors(
    const std::vector<BlockId>& ids, const std::optional<std::vector<int64_t>>& layers) const {
    for (BlockId id : ids) {
        KVMOVE_CHECK(id >= 0 && id < num_blocks(), Block,
                     "block id " << id << " is out of range: ids are in [0, " << num_blocks()
                                 << ")");
    }
    std::vector<int64_t> all_layers;
    if (!layers) {
        for (int64_t l = 0; l < num_layers_; ++l) {
            all_layers.push_back(l);
        }
    }
    const std::vector<int64_t>& wanted = layers ? *layers : all_layers;
    for (int64_t layer : wanted) {
        KVMOVE_CHECK(layer >= 0 && layer < num_layers_, Config,
                     "layer " << layer << " is out of range: layers are in [0, " << num_layers_
                              << ")");
    }
    const std::vector<BlockRun> block_runs = runs(ids);
    std::vector<Descriptor> out;
    for (int64_t layer : wanted) {
        for (auto [start, num] : block_runs) {
            Descriptor d{region_.addr() + offset(layer, start), num * block_nbytes_};
            if (!out.empty() && out.back().addr + out.back().nbytes == d.addr) {
                out.back().nbytes += d.nbytes;
            } else {
                out.push_back(d);
            }
        }
    }
    return out;
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
        if (cache->region().on_device()) {
            cuda_synchronize(cache->region().device());
        }
    }
}

namespace {

void check_ids(const KVCache& cache, const std::vector<BlockId>& ids, const char* which) {
    for (BlockId id : ids) {
        KVMOVE_CHECK(id >= 0 && id < cache.num_blocks(), Block,
                     which << " block id " << id << " is out of range: ids are in [0, "
                           << cache.num_blocks() << ")");
    }
}

}  // namespace

void copy_blocks(const KVCache& src, const std::vector<BlockId>& src_ids, KVCache& dst,
                 const std::vector<BlockId>& dst_ids) {
    KVMOVE_CHECK(src_ids.size() == dst_ids.size(), Config,
                 "copy_blocks needs as many destination ids as source ids, got "
                     << dst_ids.size() << " for " << src_ids.size());
    KVMOVE_CHECK(src.num_layers() == dst.num_layers() && src.block_nbytes() == dst.block_nbytes(),
                 Config,
                 "copy_blocks needs caches of the same shape, got " << src.num_layers() << " x "
                     << src.block_nbytes() << " B and " << dst.num_layers() << " x "
                     << dst.block_nbytes() << " B (layers x bytes per block and layer)");
    check_ids(src, src_ids, "source");
    check_ids(dst, dst_ids, "destination");
    const bool device = src.region().on_device() || dst.region().on_device();
    sync_devices(src, dst);  // what other streams wrote to either cache is there
    const auto* from = static_cast<const char*>(src.region().data());
    auto* to = static_cast<char*>(dst.region().data());
    for (size_t i = 0; i < src_ids.size();) {
        size_t n = 1;  // a run consecutive on both sides
        while (i + n < src_ids.size() && src_ids[i + n] == src_ids[i] + static_cast<int64_t>(n) &&
               dst_ids[i + n] == dst_ids[i] + static_cast<int64_t>(n)) {
            ++n;
        }
        for (int64_t layer = 0; layer < src.num_layers(); ++layer) {
            copy_bytes(to + dst.offset(layer, dst_ids[i]), from + src.offset(layer, src_ids[i]),
                       n * src.block_nbytes(), device);
        }
        i += n;
    }
    sync_devices(src, dst);  // and the copies are done when we return
}

}  // namespace kvmove
