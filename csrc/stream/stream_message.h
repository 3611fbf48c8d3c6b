// The messages of a layer stream, as the data of one UCX active message each.
//
// A stream moves one request's KV into blocks its receiver leased (stream_protocol.h has the
// protocol and its sequence diagram). The lease's epoch names the stream in every message:
//
//   sender -> receiver   Begin   "may I write your lease <epoch>?" (with the ids' hash)
//   receiver -> sender   Go      "yes: it is yours until you end it"
//                        Refuse  "no" (unknown, cancelled or expired lease; other blocks)
//   sender -> receiver   Layer   "layer i is in your blocks" (its per-block checksums)
//                        Final   "every layer is in; here is the payload"  -> Ack
//                        Abort   "I stopped, and nothing I posted is still in flight"
//   receiver -> sender   Cancel  "stop": answered by an Abort once the sender's puts landed
//                        Ack     the Final arrived
//
// Before any of it, the hand-off: the receiver tells the sender where the KV goes.
//
//   receiver -> sender   Offer   "lease <epoch>: request_id's KV goes into these blocks"
//                                (no blocks and epoch 0: "I need none of it, let it go")
//   sender -> receiver   Decline "I will not write lease <epoch>" (with the reason), only
//                                before its Begin; the lease ends at once, nothing was written
//
// The data (little-endian):
//
//   u8 version | u8 kind | u16 request_id_nbytes | u32 layer | u64 epoch | u64 ids_hash
//   | u32 num_values | request_id | num_values x u64 | payload (the rest)
//
// The u64 values are a Layer's per-block checksums or an Offer's block ids; no other kind
// carries any. ids_hash is XXH64 of the destination block ids, so a receiver can tell that the
// sender means the blocks it leased and not others. The payload is a Final's (the first
// token), or a Refuse's or Decline's reason; no other kind carries one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/kv_geometry.h"

namespace kvmove {

enum class MessageKind : uint8_t {
    Begin = 1,
    Go = 2,
    Refuse = 3,
    Layer = 4,
    Final = 5,
    Ack = 6,
    Abort = 7,
    Cancel = 8,
    Offer = 9,
    Decline = 10,
};

constexpr uint8_t kFirstMessageKind = 1;
constexpr uint8_t kLastMessageKind = 10;

// The kind's name, for messages and logs ("Begin", "Layer"...).
const char* message_kind_name(MessageKind kind);

struct StreamMessage {
    MessageKind kind = MessageKind::Layer;
    std::string request_id;
    uint32_t layer = 0;  // Layer only
    uint64_t epoch = 0;
    uint64_t ids_hash = 0;
    std::vector<uint64_t> checksums;  // Layer only: one per block, or none
    std::string payload;              // Final's payload, Refuse's and Decline's reason
    std::vector<BlockId> block_ids;   // Offer only: the leased blocks, or none
};

// 3: Offer and Decline (a peer of version 2 would drop them as unknown kinds).
// 4: a Layer's checksums are XXH3 (they were XXH64: a version 3 peer's would all mismatch).
constexpr uint8_t kStreamMessageVersion = 4;
constexpr size_t kMaxRequestIdBytes = 256;
constexpr size_t kMaxPayloadBytes = 64 * 1024;  // a Final's payload (e.g. the first token)
constexpr size_t kMaxStreamBlocks = 1 << 20;    // blocks of one stream: checksums, offered ids

// A message about one lease alone: no layer, checksums or ids (Begin, Go, Ack, Cancel...).
StreamMessage lease_message(MessageKind kind, const std::string& request_id, uint64_t epoch,
                            uint64_t ids_hash, std::string payload = "");

std::string encode(const StreamMessage& message);
// Throws MetadataError naming what is wrong: a message from a peer is untrusted input.
StreamMessage decode_stream_message(const void* data, size_t nbytes);

// XXH64 over the little-endian int64 ids, in order.
uint64_t hash_ids(const std::vector<BlockId>& ids);

}  // namespace kvmove
