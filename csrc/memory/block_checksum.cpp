#include "memory/block_checksum.h"

#include "common/errors.h"
#include "common/hash.h"
#include "memory/kv_cache.h"

namespace kvmove {

namespace {

const void* at(const Plane& plane, BlockId id) {
    return reinterpret_cast<const void*>(block_address(plane, id));
}

}  // namespace

uint64_t block_checksum(const KVGeometry& geometry, int64_t layer, BlockId id, uint64_t seed) {
    if (geometry.num_parts() == 1) {
        const Plane& plane = geometry.plane(layer, 0);
        return xxh3(at(plane, id), plane.block_nbytes, seed);
    }
    Xxh3 hash(seed);
    for (int64_t part = 0; part < geometry.num_parts(); ++part) {
        const Plane& plane = geometry.plane(layer, part);
        hash.update(at(plane, id), plane.block_nbytes);
    }
    return hash.digest();
}

uint64_t block_checksum(const KVGeometry& geometry, BlockId id, uint64_t seed) {
    Xxh3 hash(seed);
    for (const Plane& plane : geometry.planes()) {  // layer-major: layer order, then part
        hash.update(at(plane, id), plane.block_nbytes);
    }
    return hash.digest();
}

std::vector<uint64_t> block_checksums(const KVCache& cache, const std::vector<BlockId>& ids,
                                      const std::vector<uint64_t>& seeds) {
    KVMOVE_CHECK(!cache.on_device(), Config,
                 "checksums are computed on the host: this cache is on device " << cache.device());
    KVMOVE_CHECK(ids.size() == seeds.size(), Config,
                 "need one seed per block id, got " << seeds.size() << " for " << ids.size());
    std::vector<uint64_t> out(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
        KVMOVE_CHECK(ids[i] >= 0 && ids[i] < cache.num_blocks(), Block,
                     "block id " << ids[i] << " out of range [0, " << cache.num_blocks() << ")");
        out[i] = block_checksum(cache.geometry(), ids[i], seeds[i]);
    }
    return out;
}

}  // namespace kvmove
