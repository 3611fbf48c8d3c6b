#include "convert/kv_convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>

#include "common/errors.h"

namespace kvmove {

namespace {

// The planes of the given layers of cache, one per layer, with its block shape (pack/unpack).
CacheView view_of(const KVCache& cache, const std::vector<int64_t>& layers,
                  const BlockShape& shape) {
    // pack/unpack move a block as one range; a cache with K and V apart (a wrapped engine
    // cache) is not one of theirs yet (convert takes it: kv_view_of).
    KVMOVE_CHECK(
        cache.geometry().num_parts() == 1, Config,
        "pack and unpack need one part per layer, the cache has " << cache.geometry().num_parts());
    CacheView view{{}, shape, cache.device()};
    for (int64_t layer : layers) {
        view.planes.push_back(cache.geometry().plane(layer, 0));
    }
    return view;
}

// The K and V planes of the given layers, planes[2 * li + kv]: a conversion addresses K and V
// apart, so a cache that keeps them apart (two parts) and one that keeps them together
// converts alike. In a one-part block V starts half a block after K, in either head order.
CacheView kv_view_of(const KVCache& cache, const std::vector<int64_t>& layers,
                     const BlockShape& shape) {
    CacheView view{{}, shape, cache.device()};
    for (int64_t layer : layers) {
        if (cache.geometry().num_parts() == 2) {
            view.planes.push_back(cache.geometry().plane(layer, 0));
            view.planes.push_back(cache.geometry().plane(layer, 1));
        } else {
            Plane k = cache.geometry().plane(layer, 0);
            k.block_nbytes /= 2;
            Plane v = k;
            v.base += k.block_nbytes;
            view.planes.push_back(k);
            view.planes.push_back(v);
        }
    }
    return view;
}

// The given layers, checked; every layer when the list is empty.
std::vector<int64_t> checked_layers(const KVCache& cache, const std::vector<int64_t>& layers) {
    return cache.geometry().layers_or_all(layers.empty() ? std::nullopt : std::optional(layers));
}

void check_shape(const KVCache& cache, const BlockShape& s, const char* side) {
    KVMOVE_CHECK(s.order == BlockOrder::NHD || s.order == BlockOrder::HND, Config,
                 side << " order must be NHD or HND to convert, got " << order_name(s.order));
    KVMOVE_CHECK(s.block_size > 0 && s.num_kv_heads > 0 && s.head_dim > 0, Config,
                 side << " shape must be positive, got block_size " << s.block_size << ", "
                      << s.num_kv_heads << " heads, head_dim " << s.head_dim);
    KVMOVE_CHECK(s.head_first >= 0 && s.head_first + s.num_kv_heads <= s.total_kv_heads, Config,
                 side << " KV heads [" << s.head_first << ", " << s.head_first + s.num_kv_heads
                      << ") are not among its total_kv_heads " << s.total_kv_heads);
    const uint64_t nbytes = s.nbytes();
    KVMOVE_CHECK(nbytes == cache.block_nbytes(), Config,
                 side << " shape gives " << nbytes << " B per block and layer, the cache has "
                      << cache.block_nbytes());
}

// The heads both shapes hold (same model: same total_kv_heads and head_dim), as local indices.
HeadSpan head_span(const BlockShape& s, const BlockShape& d) {
    KVMOVE_CHECK(s.total_kv_heads == d.total_kv_heads && s.head_dim == d.head_dim, Config,
                 "the model's heads and head_dim must match: source "
                     << s.total_kv_heads << " x " << s.head_dim << ", destination "
                     << d.total_kv_heads << " x " << d.head_dim);
    const int32_t first = std::max(s.head_first, d.head_first);
    const int32_t end = std::min(s.head_first + s.num_kv_heads, d.head_first + d.num_kv_heads);
    KVMOVE_CHECK(first < end, Config,
                 "the source holds KV heads ["
                     << s.head_first << ", " << s.head_first + s.num_kv_heads
                     << "), the destination [" << d.head_first << ", "
                     << d.head_first + d.num_kv_heads << "): none in common");
    KVMOVE_CHECK(d.dtype != DType::Float8 || end - first == d.num_kv_heads, Config,
                 "a float8 destination's scale covers all its "
                     << d.num_kv_heads << " heads, the source holds " << end - first << " of them");
    return HeadSpan{first - s.head_first, first - d.head_first, end - first};
}

// vLLM's CPU blocks: the heads both hold, each head's run of bytes moved whole (kv_convert.h).
void convert_vllm_cpu(const KVCache& src, const BlockShape& s, const std::vector<BlockId>& src_ids,
                      KVCache& dst, const BlockShape& d, const std::vector<BlockId>& dst_ids,
                      const std::vector<int64_t>& layers) {
    KVMOVE_CHECK(s.order == BlockOrder::VllmCpu && d.order == BlockOrder::VllmCpu, Config,
                 "vllm-cpu blocks convert only into vllm-cpu blocks (vLLM's attention kernels "
                 "own the order inside a head), got "
                     << order_name(s.order) << " into " << order_name(d.order));
    KVMOVE_CHECK(s.block_size == d.block_size && s.dtype == d.dtype, Config,
                 "vllm-cpu blocks convert heads only (split or merged): block size and dtype "
                 "must match, got "
                     << s.block_size << " " << dtype_name(s.dtype) << " into " << d.block_size
                     << " " << dtype_name(d.dtype));
    KVMOVE_CHECK(!src.on_device() && !dst.on_device(), Config,
                 "vllm-cpu blocks convert in host memory only");
    KVMOVE_CHECK(src_ids.size() == dst_ids.size(), Config,
                 "same block size: as many source as destination blocks, got "
                     << src_ids.size() << " and " << dst_ids.size());
    const HeadSpan heads = head_span(s, d);
    const uint64_t run = 2ull * s.block_size * s.head_dim * dtype_nbytes(s.dtype);
    for (int64_t layer : layers) {
        for (size_t i = 0; i < src_ids.size(); ++i) {
            std::memcpy(
                reinterpret_cast<char*>(dst.geometry().address(layer, 0, dst_ids[i])) +
                    heads.dst_first * run,
                reinterpret_cast<const char*>(src.geometry().address(layer, 0, src_ids[i])) +
                    heads.src_first * run,
                heads.count * run);
        }
    }
}

// The staging buffer is the descriptors of (ids, layers) back to back: the same layer, id order.
void pack_host(const KVCache& cache, const std::vector<int64_t>& ids,
               const std::vector<int64_t>& layers, char* staging, bool unpack) {
    char* out = staging;
    for (const Descriptor& d : cache.geometry().descriptors(ids, layers)) {
        char* block = reinterpret_cast<char*>(d.addr);
        unpack ? std::memcpy(block, out, d.nbytes) : std::memcpy(out, block, d.nbytes);
        out += d.nbytes;
    }
}

// One (layer, destination block, K or V): its amax and scale when the destination is float8,
// then every element of its tokens.
void convert_host_block(const ConvertPlan& p, size_t li, size_t bi, int kv) {
    const BlockShape &s = p.src.shape, &d = p.dst.shape;
    const int64_t first = static_cast<int64_t>(bi) * d.block_size;
    const int64_t count = std::min<int64_t>(d.block_size, p.num_tokens - first);
    const HeadSpan& heads = p.heads;
    char* dst_block =
        reinterpret_cast<char*>(block_address(p.dst.planes[2 * li + kv], p.dst_ids[bi]));
    // The plane is K's or V's (kv_view_of): within it, index as K. A head's head_dim elements
    // are contiguous on both sides (element_index(..., x) is the row's index + x): the loops
    // below go a row at a time.
    auto src_row = [&](int64_t t, int h) {
        const char* block = reinterpret_cast<const char*>(
            block_address(p.src.planes[2 * li + kv], p.src_ids[t / s.block_size]));
        return block + dtype_nbytes(s.dtype) * element_index(s, 0,
                                                             static_cast<int>(t % s.block_size),
                                                             heads.src_first + h, 0);
    };
    auto dst_row = [&](int64_t t, int h) {
        return dst_block + dtype_nbytes(d.dtype) * element_index(d, 0, static_cast<int>(t - first),
                                                                 heads.dst_first + h, 0);
    };
    if (copies_bits(s.dtype, d.dtype)) {
        for (int64_t t = first; t < first + count; ++t) {
            for (int h = 0; h < heads.count; ++h) {
                std::memcpy(dst_row(t, h), src_row(t, h),
                            static_cast<size_t>(dtype_nbytes(d.dtype)) * d.head_dim);
            }
        }
        return;
    }
    auto src_scale = [&](int64_t t) {
        return s.dtype == DType::Float8
                   ? p.scales[(li * p.src_ids.size() + t / s.block_size) * 2 + kv]
                   : 1.0f;
    };
    float scale = 1.0f;
    if (d.dtype == DType::Float8) {
        float amax = 0.0f;
        for (int64_t t = first; t < first + count; ++t) {
            for (int h = 0; h < heads.count; ++h) {
                const char* in = src_row(t, h);
                for (int x = 0; x < d.head_dim; ++x) {
                    amax = std::max(amax, std::fabs(load_element(in, s.dtype, x) * src_scale(t)));
                }
            }
        }
        scale = fp8_scale(amax);
        p.scales[(li * p.dst_ids.size() + bi) * 2 + kv] = scale;
    }
    for (int64_t t = first; t < first + count; ++t) {
        const float from = src_scale(t);
        for (int h = 0; h < heads.count; ++h) {
            const char* in = src_row(t, h);
            char* out = dst_row(t, h);
            for (int x = 0; x < d.head_dim; ++x) {  // the kernel's arithmetic, in its order
                store_element(out, d.dtype, x, load_element(in, s.dtype, x) * from / scale);
            }
        }
    }
}

}  // namespace

namespace {

// pack (unpack=false) or unpack, after checking ids, layers and the staging buffer's size.
void move_packed(const KVCache& cache, const std::vector<BlockId>& ids,
                 const std::vector<int64_t>& layers, uint64_t staging_addr, uint64_t staging_nbytes,
                 bool unpack) {
    cache.geometry().check_ids(ids, "");
    const std::vector<int64_t> wanted = checked_layers(cache, layers);
    const uint64_t need = wanted.size() * ids.size() * cache.block_nbytes();
    KVMOVE_CHECK(staging_nbytes >= need, Config,
                 "the staging buffer has " << staging_nbytes << " B, " << ids.size()
                                           << " blocks of " << wanted.size() << " layers need "
                                           << need);
    auto* staging = reinterpret_cast<char*>(staging_addr);
    if (cache.on_device()) {
        pack_blocks_cuda(view_of(cache, wanted, BlockShape{}), ids, staging, unpack);
    } else {
        pack_host(cache, ids, wanted, staging, unpack);
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
    if (src_shape.order == BlockOrder::VllmCpu || dst_shape.order == BlockOrder::VllmCpu) {
        KVMOVE_CHECK(src_shape.nbytes() == src.block_nbytes() &&
                         dst_shape.nbytes() == dst.block_nbytes() &&
                         src.num_layers() == dst.num_layers(),
                     Config, "the shapes do not match the caches' blocks and layers");
        KVMOVE_CHECK(&src != &dst, Config, "vllm-cpu blocks convert between two caches");
        src.geometry().check_ids(src_ids, "");
        dst.geometry().check_ids(dst_ids, "");
        convert_vllm_cpu(src, src_shape, src_ids, dst, dst_shape, dst_ids,
                         checked_layers(src, layers));
        return;
    }
    check_shape(src, src_shape, "source");
    check_shape(dst, dst_shape, "destination");
    const HeadSpan heads = head_span(src_shape, dst_shape);
    KVMOVE_CHECK(src.device() == dst.device(), Config,
                 "both caches must be in the same memory: source on device "
                     << src.device() << ", destination on " << dst.device() << " (-1: host)");
    KVMOVE_CHECK(
        src.num_layers() == dst.num_layers(), Config,
        "the caches have " << src.num_layers() << " and " << dst.num_layers() << " layers");
    KVMOVE_CHECK(num_tokens > 0, Config, "num_tokens must be positive, got " << num_tokens);
    const int64_t src_need = (num_tokens + src_shape.block_size - 1) / src_shape.block_size;
    const int64_t dst_need = (num_tokens + dst_shape.block_size - 1) / dst_shape.block_size;
    KVMOVE_CHECK(static_cast<int64_t>(src_ids.size()) == src_need &&
                     static_cast<int64_t>(dst_ids.size()) == dst_need,
                 Config,
                 num_tokens << " tokens take " << src_need << " source and " << dst_need
                            << " destination blocks, got " << src_ids.size() << " and "
                            << dst_ids.size());
    src.geometry().check_ids(src_ids, "");
    dst.geometry().check_ids(dst_ids, "");
    const std::vector<int64_t> wanted = checked_layers(src, layers);
    ConvertPlan plan{kv_view_of(src, wanted, src_shape),
                     kv_view_of(dst, wanted, dst_shape),
                     src_ids,
                     dst_ids,
                     num_tokens,
                     heads,
                     reinterpret_cast<float*>(scales_addr)};
    const bool fp8_src = src_shape.dtype == DType::Float8;
    const bool fp8_dst = dst_shape.dtype == DType::Float8;
    KVMOVE_CHECK(!(fp8_src && fp8_dst), Config,
                 "float8 to float8 takes one scale buffer per side: convert through float16");
    if (fp8_src || fp8_dst) {
        const uint64_t need =
            wanted.size() * (fp8_dst ? dst_ids.size() : src_ids.size()) * 2 * sizeof(float);
        KVMOVE_CHECK(scales_addr != 0 && scales_nbytes >= need, Config,
                     "a float8 side needs a float32 scales buffer of " << need << " B (layers x "
                                                                       << "blocks x K/V), got "
                                                                       << scales_nbytes << " B");
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
    if (src.on_device()) {
        convert_blocks_cuda(plan);
        return;
    }
    for (size_t li = 0; li < wanted.size(); ++li) {
        for (size_t bi = 0; bi < dst_ids.size(); ++bi) {
            for (int kv = 0; kv < 2; ++kv) {
                convert_host_block(plan, li, bi, kv);
            }
        }
    }
}

}  // namespace kvmove
