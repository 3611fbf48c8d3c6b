// AgentMetadata: what one agent tells another to reach its KV cache, as versioned bytes.
//
// Wire format (little-endian), version 5:
//
//   "KVMV" | u16 version | u16 reserved (0) | u32 body_nbytes | body | u64 xxh64(body)
//   body = str8 name | u32 incarnation | u64 started_ns | bytes32 worker_address
//        | str8 boot_id | u64 netns_ino | u64 pidns_ino | u32 pid
//        | u32 num_segments | segment * num_segments
//        | u32 num_layers | u32 num_blocks | u32 num_parts | plane * (num_layers * num_parts)
//        | u32 num_kv_heads | u32 head_dim | u32 block_size | str8 dtype | str8 order
//        | u32 head_first | u32 total_kv_heads
//   segment = u64 addr | u64 nbytes | bytes32 packed_rkey | i32 memfd | u64 memfd_dev
//           | u64 memfd_ino                                    (one registered span)
//   plane   = u64 base | u64 block_stride | u64 block_nbytes | u32 segment
//
// Version 3 (was 2: one region, one key, an implied layer-major geometry) carries the whole
// geometry (common/kv_geometry.h): a wrapped engine cache has a segment per tensor and planes
// anywhere in them, and the order label (common/block_shape.h) says what a block holds. The
// decoder checks that every plane lies in its segment and that the planes' bytes per block
// are what the shape says, so two peers that pass the shape comparison copy byte for byte.
//
// Version 4 adds the KV heads the agent holds, [head_first, head_first + num_kv_heads) of
// total_kv_heads: tensor-parallel ranks hold a range each, and two agents holding other ranges
// are not identical peers (kvmove.StagingArea converts between them). A version 3 peer is
// refused rather than read as holding every head: it may be a rank of a split.
//
// Version 5 adds what a peer on the same host needs to map the agent's memory
// (transport/peer_mapping.h): the host (boot_id, the network and pid namespaces' inodes) and
// the agent's pid, and per segment the memfd holding it (its fd number in that process, -1
// for memory that is no memfd: a wrapped engine tensor, device memory, or an agent that does
// not offer mapping) with the file's (st_dev, st_ino), so a reused pid or fd number never maps
// another file. boot_id is printable, at most 64 bytes ("" when unknown: never mapped).
//
// incarnation: a random nonzero number an agent picks when it starts, the high 32 bits of the
// epochs of the leases it grants. A peer that comes back under the same name has another, so
// its survivors tell a restart from a duplicate, a new run from a replay of a run it replaced
// (transport/peer_runs.h), and a lease of the old run from one of the new
// (stream/stream_protocol.h). started_ns (the agent's start, wall clock) is informational
// only: nothing orders runs by it, since a host's clock may be behind another's or step back
// (issue 27). It stays on the wire so that version 5 peers keep reading each other.
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
#include "common/kv_geometry.h"

namespace kvmove {

// One span of the agent's memory registered with UCX, and its key.
struct RemoteSegment {
    uint64_t addr = 0;
    uint64_t nbytes = 0;
    std::vector<uint8_t> packed_rkey;
    int32_t memfd = -1;  // in the agent's process; -1: not mappable (then dev and ino are 0)
    uint64_t memfd_dev = 0;
    uint64_t memfd_ino = 0;
};

// Where an agent runs: peers with equal boot_id and namespaces share a kernel, pids and a
// network, so one may open the other's memfds through /proc/<pid>/fd.
struct HostIdentity {
    std::string boot_id;  // /proc/sys/kernel/random/boot_id; "" when unknown
    uint64_t netns_ino = 0;
    uint64_t pidns_ino = 0;
    uint32_t pid = 0;
};

struct AgentMetadata {
    std::string name;
    uint32_t incarnation = 0;
    uint64_t started_ns = 0;
    std::vector<uint8_t> worker_address;
    HostIdentity host;
    std::vector<RemoteSegment> segments;
    int64_t num_layers = 0;
    int64_t num_blocks = 0;
    int64_t num_parts = 0;
    std::vector<Plane> planes;  // layer-major, in the agent's address space
    BlockShape shape;

    // The peer's cache as a geometry (valid: decode() checked it).
    KVGeometry geometry() const { return KVGeometry(num_layers, num_blocks, num_parts, planes); }
};

constexpr uint16_t kMetadataVersion = 5;
constexpr size_t kMaxBootIdBytes = 64;
constexpr size_t kMaxAgentNameBytes = 255;
// Bounds on what a peer may announce: a model has at most a few hundred layers, and a wrapped
// cache one segment per tensor (two per layer at most).
constexpr int64_t kMaxMetadataLayers = 4096;
constexpr int64_t kMaxMetadataSegments = 2 * kMaxMetadataLayers;

// Index of the first byte of text outside printable ASCII, or npos. Names and dtypes in
// metadata must be printable; an Agent checks its own name with the same rule.
size_t first_unprintable(std::string_view text);

std::vector<uint8_t> encode(const AgentMetadata& meta);
AgentMetadata decode(const std::vector<uint8_t>& bytes);

}  // namespace kvmove
