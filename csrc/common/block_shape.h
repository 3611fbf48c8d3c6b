// BlockShape: what one block of one layer holds — how many tokens, KV heads, elements per
// head, of which type, in which order. Two agents compare it (with their layer counts) before
// any byte moves; the conversions address elements through it.
//
// A block of one layer holds K then V of block_size tokens:
//
//   NHD (token-major, FlashInfer/vLLM's default):  [2, block_size, num_kv_heads, head_dim]
//   HND (head-major):                               [2, num_kv_heads, block_size, head_dim]
//   vllm-cpu (vLLM's CPU backend):                  [num_kv_heads, block_size, 2 * head_dim]
//                                   (vLLM's attention views a head's run as K's block_size
//                                   rows, then V's; its kernels own the order inside a run:
//                                   kvmove moves a head's run whole, kv_convert.h)
//   mla (one latent per token, no V):               [block_size, head_dim]  (num_kv_heads 1)
//
// The order is the element order of the block's bytes read part after part (kv_geometry.h): a
// cache that keeps K and V in two planes ([2, N, B, H, D] per layer) holds NHD blocks too.
//
// Tensor parallelism splits the model's KV heads between ranks: a block holds heads
// [head_first, head_first + num_kv_heads) of total_kv_heads (rank r of a TP=2 split of 8 heads:
// head_first 4 * r, num_kv_heads 4, total_kv_heads 8). An unsplit cache holds [0, n) of n.
#pragma once

#include <cstdint>
#include <string>

#include "common/host_device.h"

namespace kvmove {

enum class DType : int32_t { Float32 = 0, Float16 = 1, BFloat16 = 2, Float8 = 3 };

KVMOVE_HD int dtype_nbytes(DType t) {
    return t == DType::Float32 ? 4 : (t == DType::Float8 ? 1 : 2);
}

// "float32", "float16", "bfloat16", "float8" (kvmove.KVSpec's names).
const char* dtype_name(DType t);
// The DType of a name; false when the name is none of them.
bool parse_dtype(const std::string& name, DType& out);

// The element order inside a block (above). Values are on the wire (transport/metadata.h).
enum class BlockOrder : int32_t { NHD = 0, HND = 1, VllmCpu = 2, MLA = 3 };

// "NHD", "HND", "vllm-cpu", "mla" (kvmove.KVCache.wrap's names).
const char* order_name(BlockOrder order);
// The BlockOrder of a name; false when the name is none of them.
bool parse_order(const std::string& name, BlockOrder& out);

struct BlockShape {
    int32_t block_size = 0;
    int32_t num_kv_heads = 0;
    int32_t head_dim = 0;
    DType dtype = DType::Float16;
    BlockOrder order = BlockOrder::NHD;
    int32_t head_first = 0;
    int32_t total_kv_heads = 0;  // set by every maker of a shape: the model's KV heads

    KVMOVE_HD bool head_major() const { return order == BlockOrder::HND; }
    // 2 (K and V), or 1 for an MLA latent.
    KVMOVE_HD int kv_count() const { return order == BlockOrder::MLA ? 1 : 2; }
    // Bytes of one block of one layer: K and V (or the latent).
    KVMOVE_HD uint64_t nbytes() const {
        return static_cast<uint64_t>(kv_count()) * static_cast<uint64_t>(block_size) *
               num_kv_heads * head_dim * dtype_nbytes(dtype);
    }
};

// "" when the two caches hold the same KV, else the first difference, naming both values:
// "num_kv_heads: 8 here, 4 at 'decode-0'".
std::string shape_difference(int64_t num_layers, const BlockShape& here, int64_t peer_num_layers,
                             const BlockShape& there, const std::string& peer);

}  // namespace kvmove
