// KVGeometry: where every block of every layer of a KV cache lives. The one place a block's
// address is computed; transfers, copies, descriptors, the disk tier and the conversion
// kernels all ask it.
//
// A cache is a list of planes. A plane holds one part of every block, at a fixed stride:
//
//   plane:  | block 0 | block 1 | ... | block N-1 |     block b at  base + b * block_stride
//           |<-block_nbytes->|                          (block_stride >= block_nbytes)
//
// Plane (layer, part) is planes[layer * num_parts + part]. kvmove's own KVCache keeps K and V
// of a block together ([L, N, 2, B, H, D]), one part per layer, the planes back to back:
//
//   region | plane 0 = layer 0              | plane 1 = layer 1              | ...
//          | block 0 | block 1 | ... | N-1  | block 0 | block 1 | ... | N-1  |
//
//   address(layer, 0, block) = base + (layer * N + block) * block_nbytes
//
// An engine that keeps K and V apart (vLLM's flash layout, [2, N, B, H, D] per layer) has two
// parts per layer; one that interleaves them inside a block has one. Blocks b and b + 1 of a
// plane touch when block_stride == block_nbytes: then a run of consecutive ids is one range.
//
// A block's bytes are its parts read one after the other (part 0, then part 1): two caches
// whose blocks hold the same elements in the same order (BlockShape) copy byte for byte even
// when one splits a block into two parts and the other does not. Each plane lies in one
// segment: a span of memory registered once with the transport (a wrapped cache has one per
// engine tensor, kvmove's own cache one for its region). A copy never spans two segments.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/host_device.h"

namespace kvmove {

// Ids are 64-bit at the API so an out-of-range value is reported, not truncated.
using BlockId = int64_t;
using BlockHash = uint64_t;
// (first id, number of blocks) of consecutive ids.
using BlockRun = std::pair<BlockId, int64_t>;

// Consecutive ascending ids grouped into runs, in the order given:
// [4, 5, 6, 9, 2, 3] -> [(4, 3), (9, 1), (2, 2)].
std::vector<BlockRun> runs(const std::vector<BlockId>& ids);

// A contiguous byte range of host or device memory.
struct Descriptor {
    uint64_t addr;
    uint64_t nbytes;
};

// One part of every block of one layer (see above).
struct Plane {
    uint64_t base;
    uint64_t block_stride;
    uint64_t block_nbytes;
    uint32_t segment = 0;  // index of the registered span holding it
};

KVMOVE_HD uint64_t block_address(const Plane& plane, int64_t block) {
    return plane.base + static_cast<uint64_t>(block) * plane.block_stride;
}

// Two ranges, one on each of two geometries, that correspond byte for byte.
struct RangePair {
    uint64_t here;
    uint64_t there;
    uint64_t nbytes;
    uint32_t here_segment = 0;
    uint32_t there_segment = 0;
};

class KVGeometry {
public:
    // planes: num_layers * num_parts of them, layer-major. Throws ConfigError for counts out
    // of range, a stride below its block, or a plane whose last block overflows 64 bits.
    KVGeometry(int64_t num_layers, int64_t num_blocks, int64_t num_parts,
               std::vector<Plane> planes);
    // kvmove's own layout: one part per layer, planes back to back from base.
    static KVGeometry layer_major(uint64_t base, int64_t num_layers, int64_t num_blocks,
                                  uint64_t block_nbytes);

    int64_t num_layers() const { return num_layers_; }
    int64_t num_blocks() const { return num_blocks_; }
    int64_t num_parts() const { return num_parts_; }
    const std::vector<Plane>& planes() const { return planes_; }
    const Plane& plane(int64_t layer, int64_t part) const {
        return planes_[static_cast<size_t>(layer * num_parts_ + part)];
    }
    // Bytes of one block in one layer, every part.
    uint64_t block_nbytes() const { return block_nbytes_; }
    uint64_t address(int64_t layer, int64_t part, BlockId block) const {
        return block_address(plane(layer, part), block);
    }

    // BlockError for an id outside [0, num_blocks), naming `which` ("source"...; "" for none).
    void check_ids(const std::vector<BlockId>& ids, const char* which) const;
    // The given layers, checked (ConfigError), or every layer when nullopt.
    std::vector<int64_t> layers_or_all(const std::optional<std::vector<int64_t>>& layers) const;

    // Byte ranges holding ids in the given layers (validated), in layer, part, then id order;
    // ranges that touch merge into one.
    std::vector<Descriptor> descriptors(const std::vector<BlockId>& ids,
                                        const std::vector<int64_t>& layers) const;

private:
    int64_t num_layers_;
    int64_t num_blocks_;
    int64_t num_parts_;
    uint64_t block_nbytes_ = 0;
    std::vector<Plane> planes_;
};

// "" when every plane of g lies inside its segment (segments[plane.segment]), else the first
// plane that does not, and why.
std::string outside_segments(const KVGeometry& g, const std::vector<Descriptor>& segments);

// "" when blocks of a and b can be copied byte for byte (same layers, same bytes per block;
// the parts may split a block differently), else what differs.
std::string copy_difference(const KVGeometry& a, const KVGeometry& b);

// The ranges that copy here_ids[i] of `here` <-> there_ids[i] of `there` in the given layers.
// A block is cut where either side's parts meet; each piece of a pair of runs consecutive on
// both sides is one range when both pieces are whole parts of dense planes (else one per
// block), and a range that continues the previous one on both sides, in the same segments,
// merges with it. Inputs must be validated (ids in range, equal lengths, copy_difference
// empty).
std::vector<RangePair> pair_ranges(const KVGeometry& here, const std::vector<BlockId>& here_ids,
                                   const KVGeometry& there, const std::vector<BlockId>& there_ids,
                                   const std::vector<int64_t>& layers);

}  // namespace kvmove
