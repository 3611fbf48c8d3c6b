// Per-block checksums of KV bytes: XXH3 (common/hash.h) of one block's bytes, its parts read
// one after another as one range, so peers or tiers that split a block differently (K and V
// apart on one side, together on the other) agree. Reads host memory only; no lock.
//
// Used by the layer stream (one layer of a block, seeded with its lease, layer and position)
// and by the storage tiers (every layer of a block, seeded with its content hash).
#pragma once

#include <cstdint>
#include <vector>

#include "common/kv_geometry.h"

namespace kvmove {

class KVCache;

// Block id's bytes in one layer.
uint64_t block_checksum(const KVGeometry& geometry, int64_t layer, BlockId id, uint64_t seed);
// Block id's bytes in every layer, in layer order.
uint64_t block_checksum(const KVGeometry& geometry, BlockId id, uint64_t seed);
// block_checksum(cache, ids[i], seeds[i]) for each i. ConfigError for a cache on a device or
// mismatched lengths, BlockError for an id out of range.
std::vector<uint64_t> block_checksums(const KVCache& cache, const std::vector<BlockId>& ids,
                                      const std::vector<uint64_t>& seeds);

}  // namespace kvmove
