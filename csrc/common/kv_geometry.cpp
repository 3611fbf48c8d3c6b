#include "common/kv_geometry.h"

#include <algorithm>
#include <climits>
#include <sstream>
#include <string>

#include "common/errors.h"

namespace kvmove {

std::vector<BlockRun> runs(const std::vector<BlockId>& ids) {
    std::vector<BlockRun> out;
    for (BlockId id : ids) {
        if (!out.empty() && out.back().first + out.back().second == id) {
            ++out.back().second;
        } else {
            out.emplace_back(id, 1);
        }
    }
    return out;
}

KVGeometry::KVGeometry(int64_t num_layers, int64_t num_blocks, int64_t num_parts,
                       std::vector<Plane> planes)
    : num_layers_(num_layers),
      num_blocks_(num_blocks),
      num_parts_(num_parts),
      planes_(std::move(planes)) {
    KVMOVE_CHECK(num_layers > 0 && num_layers <= INT32_MAX, Config,
                 "num_layers must be in [1, " << INT32_MAX << "], got " << num_layers);
    KVMOVE_CHECK(num_blocks > 0 && num_blocks <= INT32_MAX, Config,
                 "num_blocks must be in [1, " << INT32_MAX << "], got " << num_blocks);
    KVMOVE_CHECK(num_parts == 1 || num_parts == 2, Config,
                 "a layer has 1 or 2 parts (K and V together, or apart), got " << num_parts);
    KVMOVE_CHECK(planes_.size() == static_cast<size_t>(num_layers * num_parts), Config,
                 num_layers << " layers of " << num_parts << " parts need "
                            << num_layers * num_parts << " planes, got " << planes_.size());
    for (int64_t part = 0; part < num_parts; ++part) {
        block_nbytes_ += planes_[static_cast<size_t>(part)].block_nbytes;
    }
    for (size_t i = 0; i < planes_.size(); ++i) {
        const Plane& p = planes_[i];
        const int64_t layer = static_cast<int64_t>(i) / num_parts;
        KVMOVE_CHECK(p.block_nbytes > 0 && p.block_stride >= p.block_nbytes, Config,
                     "plane " << i << " (layer " << layer << "): blocks of " << p.block_nbytes
                              << " B need a block stride >= that, got " << p.block_stride);
        KVMOVE_CHECK(p.block_nbytes == planes_[i % num_parts].block_nbytes, Config,
                     "plane " << i << " (layer " << layer << ") has blocks of " << p.block_nbytes
                              << " B, layer 0 has " << planes_[i % num_parts].block_nbytes);
        uint64_t last = 0;
        bool overflow =
            __builtin_mul_overflow(static_cast<uint64_t>(num_blocks - 1), p.block_stride, &last) ||
            __builtin_add_overflow(last, p.base, &last) ||
            __builtin_add_overflow(last, p.block_nbytes, &last);
        KVMOVE_CHECK(!overflow, Config,
                     "plane " << i << ": " << num_blocks << " blocks at stride " << p.block_stride
                              << " from 0x" << std::hex << p.base << std::dec
                              << " overflow 64 bits");
    }
}

KVGeometry KVGeometry::layer_major(uint64_t base, int64_t num_layers, int64_t num_blocks,
                                   uint64_t block_nbytes) {
    std::vector<Plane> planes;
    const uint64_t plane_nbytes = static_cast<uint64_t>(num_blocks) * block_nbytes;
    for (int64_t layer = 0; layer < num_layers; ++layer) {
        planes.push_back(
            {base + static_cast<uint64_t>(layer) * plane_nbytes, block_nbytes, block_nbytes});
    }
    return KVGeometry(num_layers, num_blocks, 1, std::move(planes));
}

void KVGeometry::check_ids(const std::vector<BlockId>& ids, const char* which) const {
    for (BlockId id : ids) {
        KVMOVE_CHECK(id >= 0 && id < num_blocks_, Block,
                     (*which ? std::string(which) + " block " : std::string("block id "))
                         << id << " is out of range: ids are in [0, " << num_blocks_ << ")");
    }
}

std::vector<int64_t> KVGeometry::layers_or_all(
    const std::optional<std::vector<int64_t>>& layers) const {
    std::vector<int64_t> out;
    if (!layers) {
        for (int64_t l = 0; l < num_layers_; ++l) {
            out.push_back(l);
        }
        return out;
    }
    for (int64_t layer : *layers) {
        KVMOVE_CHECK(
            layer >= 0 && layer < num_layers_, Config,
            "layer " << layer << " is out of range: layers are in [0, " << num_layers_ << ")");
    }
    return *layers;
}

namespace {

// Appends [addr, addr + nbytes), merging it into the last descriptor when the two touch.
void append(std::vector<Descriptor>& out, uint64_t addr, uint64_t nbytes, bool merge) {
    if (merge && !out.empty() && out.back().addr + out.back().nbytes == addr) {
        out.back().nbytes += nbytes;
    } else {
        out.push_back({addr, nbytes});
    }
}

void append(std::vector<RangePair>& out, const RangePair& r) {
    if (!out.empty() && out.back().here + out.back().nbytes == r.here &&
        out.back().there + out.back().nbytes == r.there &&
        out.back().here_segment == r.here_segment && out.back().there_segment == r.there_segment) {
        out.back().nbytes += r.nbytes;
    } else {
        out.push_back(r);
    }
}

bool dense(const Plane& p) {
    return p.block_stride == p.block_nbytes;
}

// Where a layer's block is cut into parts: offsets 0, part 0's bytes, ..., block_nbytes.
std::vector<uint64_t> part_starts(const KVGeometry& g, int64_t layer) {
    std::vector<uint64_t> out{0};
    for (int64_t part = 0; part < g.num_parts(); ++part) {
        out.push_back(out.back() + g.plane(layer, part).block_nbytes);
    }
    return out;
}

}  // namespace

std::vector<Descriptor> KVGeometry::descriptors(const std::vector<BlockId>& ids,
                                                const std::vector<int64_t>& layers) const {
    const std::vector<BlockRun> block_runs = runs(ids);
    std::vector<Descriptor> out;
    uint32_t last_segment = 0;
    for (int64_t layer : layers) {
        for (int64_t part = 0; part < num_parts_; ++part) {
            const Plane& p = plane(layer, part);
            for (auto [start, num] : block_runs) {
                for (int64_t i = 0; i < (dense(p) ? 1 : num); ++i) {
                    // Ranges of two segments (two engine tensors) never merge.
                    append(out, block_address(p, start + i), (dense(p) ? num : 1) * p.block_nbytes,
                           p.segment == last_segment);
                    last_segment = p.segment;
                }
            }
        }
    }
    return out;
}

std::string outside_segments(const KVGeometry& g, const std::vector<Descriptor>& segments) {
    std::ostringstream os;
    for (size_t i = 0; i < g.planes().size() && os.tellp() == 0; ++i) {
        const Plane& p = g.planes()[i];
        if (p.segment >= segments.size()) {
            os << "plane " << i << " is in segment " << p.segment << " of " << segments.size();
            break;
        }
        const Descriptor& s = segments[p.segment];
        // The constructor checked that the plane's end does not overflow.
        const uint64_t end =
            p.base + static_cast<uint64_t>(g.num_blocks() - 1) * p.block_stride + p.block_nbytes;
        if (p.base < s.addr || end - s.addr > s.nbytes) {
            os << "plane " << i << " (layer " << static_cast<int64_t>(i) / g.num_parts()
               << ") spans [0x" << std::hex << p.base << ", 0x" << end
               << "), outside its segment [0x" << s.addr << ", +" << std::dec << s.nbytes << ")";
        }
    }
    return os.str();
}

std::string copy_difference(const KVGeometry& a, const KVGeometry& b) {
    std::ostringstream os;
    if (a.num_layers() != b.num_layers()) {
        os << "num_layers " << a.num_layers() << " vs " << b.num_layers();
    } else if (a.block_nbytes() != b.block_nbytes()) {
        os << "bytes per block and layer " << a.block_nbytes() << " vs " << b.block_nbytes();
    }
    return os.str();
}

namespace {

// Runs of (here, there) pairs consecutive on both sides.
struct PairRun {
    BlockId here, there;
    int64_t num;
};

std::vector<PairRun> pair_runs(const std::vector<BlockId>& here_ids,
                               const std::vector<BlockId>& there_ids) {
    std::vector<PairRun> out;
    for (size_t i = 0; i < here_ids.size(); ++i) {
        PairRun* last = out.empty() ? nullptr : &out.back();
        if (last != nullptr && last->here + last->num == here_ids[i] &&
            last->there + last->num == there_ids[i]) {
            ++last->num;
        } else {
            out.push_back({here_ids[i], there_ids[i], 1});
        }
    }
    return out;
}

}  // namespace

// Per layer, the block's bytes [0, block_nbytes) are walked piece by piece, a piece ending
// wherever a part ends on either side (the two may cut a block differently: K and V apart on
// one, together on the other). With equal parts, the common case, a piece is a whole part.
std::vector<RangePair> pair_ranges(const KVGeometry& here, const std::vector<BlockId>& here_ids,
                                   const KVGeometry& there, const std::vector<BlockId>& there_ids,
                                   const std::vector<int64_t>& layers) {
    const std::vector<PairRun> pairs = pair_runs(here_ids, there_ids);
    std::vector<RangePair> out;
    out.reserve(pairs.size() * layers.size() * static_cast<size_t>(here.num_parts()));
    for (int64_t layer : layers) {
        const std::vector<uint64_t> a_starts = part_starts(here, layer);
        const std::vector<uint64_t> b_starts = part_starts(there, layer);
        size_t ai = 0, bi = 0;
        for (uint64_t lo = 0; lo < here.block_nbytes();) {
            const uint64_t hi = std::min(a_starts[ai + 1], b_starts[bi + 1]);
            const Plane& a = here.plane(layer, static_cast<int64_t>(ai));
            const Plane& b = there.plane(layer, static_cast<int64_t>(bi));
            const uint64_t a_off = lo - a_starts[ai], b_off = lo - b_starts[bi];
            const bool whole = hi - lo == a.block_nbytes && hi - lo == b.block_nbytes;
            const bool whole_runs = whole && dense(a) && dense(b);
            for (const PairRun& run : pairs) {
                for (int64_t i = 0; i < (whole_runs ? 1 : run.num); ++i) {
                    append(out, {block_address(a, run.here + i) + a_off,
                                 block_address(b, run.there + i) + b_off,
                                 (whole_runs ? static_cast<uint64_t>(run.num) : 1) * (hi - lo),
                                 a.segment, b.segment});
                }
            }
            lo = hi;
            ai += a_starts[ai + 1] == hi ? 1 : 0;
            bi += b_starts[bi + 1] == hi ? 1 : 0;
        }
    }
    return out;
}

}  // namespace kvmove
