// The messages of a layer stream, as the data of one UCX active message each.
//
// A sender tells its receiver, per request: "layer i is in your blocks" (Layer), "every layer
// is in, here is the payload" (Final) or "stop, the request is cancelled" (Abort); the
// receiver answers a Final with an Ack, which is how the sender knows it was delivered. The
// active message's header is the sending agent's name; its data (little-endian):
//
//   u8 version | u8 kind | u16 request_id_nbytes | i32 layer | u64 ids_hash | u64 serial
//   | request_id | payload (the rest; Final only)
//
// ids_hash is XXH64 of the destination block ids, so a receiver can tell that the sender
// wrote the blocks it reserved for the request and not others. serial tells streams of one
// request id apart (a sender may reuse an id once its stream ended): a load takes the
// messages of one serial only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "memory/block_pool.h"

namespace kvmove {

enum class MessageKind : uint8_t { Layer = 1, Final = 2, Abort = 3, Ack = 4 };

struct StreamMessage {
    MessageKind kind = MessageKind::Layer;
    std::string request_id;
    int32_t layer = -1;  // Layer only
    uint64_t ids_hash = 0;
    uint64_t serial = 0;
    std::string payload;  // Final only
};

constexpr uint8_t kStreamMessageVersion = 1;
constexpr size_t kMaxRequestIdBytes = 256;
constexpr size_t kMaxPayloadBytes = 64 * 1024;  // a Final's payload (e.g. the first token)

std::string encode(const StreamMessage& message);
// Throws MetadataError naming what is wrong: a message from a peer is untrusted input.
StreamMessage decode_stream_message(const void* data, size_t nbytes);

// XXH64 over the little-endian int64 ids, in order.
uint64_t hash_ids(const std::vector<BlockId>& ids);

}  // namespace kvmove
