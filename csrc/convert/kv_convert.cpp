#include "convert/kv_convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>

#include "common/errors.h"

namespace kvmove {

namespace {

CacheView view_of(const KVCache& cache, const BlockShape& shape) {
    return {static_cast<char*>(const_cast<void*>(cache.region().data())), cache.num_blocks(),
            cache.block_nbytes(), shape, cache.region().device()};
}

std::vector<int64_t> checked_layers(const KVCache& cache, const std::vector<int64_t>& layers) {
    std::vector<int64_t> out = layers;
    if (out.empty()) {
        for (int64_t l = 0; l < cache.num_layers(); ++l) {
            out.push_back(l);
        }
    }
    for (int64_t l : out) {
        KVMOVE_CHECK(l >= 0 && l < cache.num_layers(), Config,
                     "layer " << l << " is out of range: layers are in [0, " << cache.num_layers()
                              << ")");
    }
    return out;
}

void check_ids(const KVCache& cache, const std::vector<BlockId>& ids) {
    for (BlockId id : ids) {
        KVMOVE_CHECK(id >= 0 && id < cache.num_blocks(), Block,
                     "block id " << id << " is out of range: ids are in [0, "
                                 << cache.num_blocks() << ")");
    }
}

void check_shape(const KVCache& cache, const BlockShape& s, const char* side) {
    KVMOVE_CHECK(s.block_size > 0 && s.num_heads > 0 && s.head_dim > 0, Config,
                 side << " shape must be positive, got block_size " << s.block_size << ", "
                      << s.num_heads << " heads, head_dim " << s.head_dim);
    const uint64_t nbytes = 2ULL * s.block_size * s.num_heads * s.head_dim * dtype_nbytes(s.dtype);
    KVMOVE_CHECK(nbytes == cache.block_nbytes(), Config,
                 side << " shape gives " << nbytes << " B per block and layer, the cache has "
                      << cache.block_nbytes());
}

void pack_host(const CacheView& cache, const std::vector<int64_t>& ids,
               const std::vector<int64_t>& layers, char* staging, bool unpack) {
    char* out = staging;
    for (int64_t layer : layers) {
        for (size_t i = 0; i < ids.size();) {
            size_t n = 1;  // consecutive ids: one copy
            while (i + n < ids.size() && ids[i + n] == ids[i] + static_cast<int64_t>(n)) {
                ++n;
            }
            char* block = cache.base + (layer * cache.num_blocks + ids[i]) * cache.block_nbytes;
            const uint64_t nbytes = n * cache.block_nbytes;
            unpack ? std::memcpy(block, out, nbytes) : std::memcpy(out, block, nbytes);
            out += nbytes;
            i += n;
        }
    }
}

// One (layer, destination block, K or V): its amax and scale when the destination is float8,
// then every element of its tokens.
void convert_host_block(const ConvertPlan& p, size_t li, size_t bi, int kv) {
    const BlockShape &s = p.src.shape, &d = p.dst.shape;
    const int64_t layer = p.layers[li];
    const int64_t first = static_cast<int64_t>(bi) * d.block_size;
    const int64_t count = std::min<int64_t>(d.block_size, p.num_tokens - first);
    auto src_block = [&](int64_t t) {
        return p.src.base + (layer * p.src.num_blocks + p.src_ids[t / s.block_size]) *
                                p.src.block_nbytes;
    };
    auto src_scale = [&](int64_t t) {
        return s.dtype == DType::Float8
                   ? p.scales[(li * p.src_ids.size() + t / s.block_size) * 2 + kv]
                   : 1.0f;
    };
    auto value = [&](int64_t t, int h, int x) {
        return load_element(src_block(t), s.dtype,
                            element_index(s, kv, static_cast<int>(t % s.block_size), h, x)) *
               src_scale(t);
    };
    float scale = 1.0f;
    if (d.dtype == DType::Float8) {
        float amax = 0.0f;
        for (int64_t t = first; t < first + count; ++t) {
            for (int h = 0; h < d.num_heads; ++h) {
                for (int x = 0; x < d.head_dim; ++x) {
                    amax = std::max(amax, std::fabs(value(t, h, x)));
                }
            }
        }
        scale = fp8_scale(amax);
        p.scales[(li * p.dst_ids.size() + bi) * 2 + kv] = scale;
    }
    char* dst_block = p.dst.base + (layer * p.dst.num_blocks + p.dst_ids[bi]) * p.dst.block_nbytes;
    for (int64_t t = first; t < first + count; ++t) {
        for (int h = 0; h < d.num_heads; ++h) {
            for (int x = 0; x < d.head_dim; ++x) {
                store_element(dst_block, d.dtype,
                              element_index(d, kv, static_cast<int>(t - first), h, x),
                              value(t, h, x) / scale);
            }
        }
    }
}

}  // namespace

namespace {

// pack (unpack=false) or unpack, after checking ids, layers and the staging buffer's size.
void move_packed(const KVCache& cache, const std::vector<BlockId>& ids,
                 const std::vector<int64_t>& layers, uint64_t staging_addr,
                 uint64_t staging_nbytes, bool unpack) {
    check_ids(cache, ids);
    const std::vector<int64_t> wanted = checked_layers(cache, layers);
    const uint64_t need = wanted.size() * ids.size() * cache.block_nbytes();
    KVMOVE_CHECK(staging_nbytes >= need, Config,
                 "the staging buffer has " << staging_nbytes << " B, " << ids.size()
                                           << " blocks of " << wanted.size() << " layers need "
                                           << need);
    CacheView view = view_of(cache, BlockShape{});
    auto* staging = reinterpret_cast<char*>(staging_addr);
    if (cache.region().on_device()) {
        pack_blocks_cuda(view, ids, wanted, staging, unpack);
    } else {
        pack_host(view, ids, wanted, staging, unpack);
    }
}

}  // namespace

void pack_blocks(const KVCache& cache, const std::vector<BlockId>& ids,
                 const std::vector<int64_t>& layers, uint64_t staging_addr,
                 uint64_t staging_nbytes) {
    move_packed(cache, ids, layers, staging_addr, staging_nbytes, false);
}

void unpack_blocks(uint64_t staging_addr, uint64_t staging_nbytes, KVCache& cache,
                   const std::vector<BlockId>& ids, const std::vector<int64_t>& layers) {
    move_packed(cache, ids, layers, staging_addr, staging_nbytes, true);
}

void convert_blocks(const KVCache& src, const BlockShape& src_shape,
                    const std::vector<BlockId>& src_ids, KVCache& dst, const BlockShape& dst_shape,
                    const std::vector<BlockId>& dst_ids, int64_t num_tokens,
                    const std::vector<int64_t>& layers, uint64_t scales_addr,
                    uint64_t scales_nbytes) {
    check_shape(src, src_shape, "source");
    check_shape(dst, dst_shape, "destination");
    KVMOVE_CHECK(src_shape.num_heads == dst_shape.num_heads &&
                     src_shape.head_dim == dst_shape.head_dim,
                 Config,
                 "heads and head_dim must match: source " << src_shape.num_heads << " x "
                     << src_shape.head_dim << ", destination " << dst_shape.num_heads << " x "
                     << dst_shape.head_dim);
    KVMOVE_CHECK(src.region().device() == dst.region().device(), Config,
                 "both caches must be in the same memory: source on device "
                     << src.region().device() << ", destination on " << dst.region().device()
                     << " (-1: host)");
    KVMOVE_CHECK(src.num_layers() == dst.num_layers(), Config,
                 "the caches have " << src.num_layers() << " and " << dst.num_layers()
                                    << " layers");
    KVMOVE_CHECK(num_tokens > 0, Config, "num_tokens must be positive, got " << num_tokens);
    const int64_t src_need = (num_tokens + src_shape.block_size - 1) / src_shape.block_size;
    const int64_t dst_need = (num_tokens + dst_shape.block_size - 1) / dst_shape.block_size;
    KVMOVE_CHECK(static_cast<int64_t>(src_ids.size()) == src_need &&
                     static_cast<int64_t>(dst_ids.size()) == dst_need,
                 Config,
                 num_tokens << " tokens take " << src_need << " source and " << dst_need
                            << " destination blocks, got " << src_ids.size() << " and "
                            << dst_ids.size());
    check_ids(src, src_ids);
    check_ids(dst, dst_ids);
    ConvertPlan plan{view_of(src, src_shape), view_of(dst, dst_shape), src_ids, dst_ids,
                     checked_layers(src, layers), num_tokens,
                     reinterpret_cast<float*>(scales_addr)};
    const bool fp8_src = src_shape.dtype == DType::Float8;
    const bool fp8_dst = dst_shape.dtype == DType::Float8;
    KVMOVE_CHECK(!(fp8_src && fp8_dst), Config,
                 "float8 to float8 takes one scale buffer per side: convert through float16");
    if (fp8_src || fp8_dst) {
        const uint64_t need = plan.layers.size() * (fp8_dst ? dst_ids.size() : src_ids.size()) *
                              2 * sizeof(float);
        KVMOVE_CHECK(scales_addr != 0 && scales_nbytes >= need, Config,
                     "a float8 side needs a float32 scales buffer of " << need << " B (layers x "
                         << "blocks x K/V), got " << scales_nbytes << " B");
    }
    if (&src == &dst) {
        std::vector<BlockId> a = src_ids, b = dst_ids;
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        std::vector<BlockId> both;
        std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
        KVMOVE_CHECK(both.empty(), Config,
                     "converting within one cache needs disjoint blocks; block "
                         << both.front() << " is both source and destination");
    }
    if (src.region().on_device()) {
        convert_blocks_cuda(plan);
        return;
    }
    for (size_t li = 0; li < plan.layers.size(); ++li) {
        for (size_t bi = 0; bi < dst_ids.size(); ++bi) {
            for (int kv = 0; kv < 2; ++kv) {
                convert_host_block(plan, li, bi, kv);
            }
        }
    }
}

}  // namespace kvmove
