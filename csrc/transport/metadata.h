// AgentMetadata: what one agent tells another to reach its KV cache, as versioned bytes.
//
// Wire format (little-endian):
//
//   "KVMV" | u16 version | u16 reserved (0) | u32 body_nbytes | body | u64 xxh64(body)
//   body = str8 name | u32 incarnation | u64 started_ns | bytes32 worker_address | u64 region_addr
//        | u64 region_nbytes | bytes32 packed_rkey | u32 num_layers | u32 num_blocks
//        | u64 block_nbytes | u32 num_kv_heads | u32 head_dim | u32 block_size | str8 dtype
//
// incarnation: a random nonzero number an agent picks when it starts, the high 32 bits of the
// epochs of the leases it grants. A peer that comes back under the same name has another, so
// its survivors tell a restart from a duplicate, and a lease of the old run from one of the
// new (stream/stream_protocol.h). started_ns (the agent's start, wall clock) orders two runs of
// one name: a survivor takes a newer run's metadata and refuses an older one's (a replay).
//
// decode() checks every length against what is left, every count against its limit, the
// checksum and that nothing trails, and throws MetadataError naming the field. The checksum
// turns accidental corruption inside the opaque UCX address and key (which UCX cannot
// validate) into an error instead of a crash; it is not a defence against a forger.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/block_shape.h"

namespace kvmove {

struct AgentMetadata {
    std::string name;
    uint32_t incarnation = 0;
    uint64_t started_ns = 0;
    std::vector<uint8_t> worker_address;
    uint64_t region_addr = 0;
    uint64_t region_nbytes = 0;
    std::vector<uint8_t> packed_rkey;
    int64_t num_layers = 0;
    int64_t num_blocks = 0;
    uint64_t block_nbytes = 0;
    BlockShape shape;  // the wire carries no order yet: NHD
};

constexpr uint16_t kMetadataVersion = 2;
constexpr size_t kMaxAgentNameBytes = 255;

// Index of the first byte of text outside printable ASCII, or npos. Names and dtypes in
// metadata must be printable; an Agent checks its own name with the same rule.
size_t first_unprintable(std::string_view text);

std::vector<uint8_t> encode(const AgentMetadata& meta);
AgentMetadata decode(const std::vector<uint8_t>& bytes);

}  // namespace kvmove
