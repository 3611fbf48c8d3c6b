#include "stream/stream_message.h"

#include <cstring>
#include <limits>

#include "common/errors.h"
#include "common/hash.h"

namespace kvmove {

namespace {

constexpr size_t kFixedBytes = 1 + 1 + 2 + 4 + 8 + 8 + 4;

template <typename T>
void put(std::string& out, T value) {
    for (size_t i = 0; i < sizeof(T); ++i) {
        out.push_back(static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
    }
}

template <typename T>
T get(const uint8_t* p) {
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
        v |= static_cast<uint64_t>(p[i]) << (8 * i);
    }
    return static_cast<T>(v);
}

bool may_carry_payload(MessageKind kind) {
    return kind == MessageKind::Final || kind == MessageKind::Refuse ||
           kind == MessageKind::Decline;
}

bool may_carry_values(MessageKind kind) {
    return kind == MessageKind::Layer || kind == MessageKind::Offer;
}

}  // namespace

const char* message_kind_name(MessageKind kind) {
    switch (kind) {
        case MessageKind::Begin:
            return "Begin";
        case MessageKind::Go:
            return "Go";
        case MessageKind::Refuse:
            return "Refuse";
        case MessageKind::Layer:
            return "Layer";
        case MessageKind::Final:
            return "Final";
        case MessageKind::Ack:
            return "Ack";
        case MessageKind::Abort:
            return "Abort";
        case MessageKind::Cancel:
            return "Cancel";
        case MessageKind::Offer:
            return "Offer";
        case MessageKind::Decline:
            return "Decline";
    }
    return "unknown";
}

StreamMessage lease_message(MessageKind kind, const std::string& request_id, uint64_t epoch,
                            uint64_t ids_hash, std::string payload) {
    StreamMessage m;
    m.kind = kind;
    m.request_id = request_id;
    m.epoch = epoch;
    m.ids_hash = ids_hash;
    m.payload = std::move(payload);
    return m;
}

std::string encode(const StreamMessage& m) {
    // One array of u64 values on the wire: an Offer's ids, else (a Layer's) checksums.
    const bool ids = m.kind == MessageKind::Offer;
    const size_t num_values = ids ? m.block_ids.size() : m.checksums.size();
    std::string out;
    out.reserve(kFixedBytes + m.request_id.size() + 8 * num_values + m.payload.size());
    put<uint8_t>(out, kStreamMessageVersion);
    put<uint8_t>(out, static_cast<uint8_t>(m.kind));
    put<uint16_t>(out, static_cast<uint16_t>(m.request_id.size()));
    put<uint32_t>(out, m.layer);
    put<uint64_t>(out, m.epoch);
    put<uint64_t>(out, m.ids_hash);
    put<uint32_t>(out, static_cast<uint32_t>(num_values));
    out += m.request_id;
    for (size_t i = 0; i < num_values; ++i) {
        put<uint64_t>(out, ids ? static_cast<uint64_t>(m.block_ids[i]) : m.checksums[i]);
    }
    out += m.payload;
    return out;
}

StreamMessage decode_stream_message(const void* data, size_t nbytes) {
    auto p = static_cast<const uint8_t*>(data);
    KVMOVE_CHECK(nbytes >= kFixedBytes, Metadata,
                 "stream message of " << nbytes << " bytes is shorter than its " << kFixedBytes
                                      << "-byte header");
    KVMOVE_CHECK(p[0] == kStreamMessageVersion, Metadata,
                 "stream message version " << int(p[0]) << ", this kvmove speaks "
                                           << int(kStreamMessageVersion));
    const uint8_t kind = p[1];
    KVMOVE_CHECK(kind >= kFirstMessageKind && kind <= kLastMessageKind, Metadata,
                 "unknown stream message kind " << int(kind));
    StreamMessage m;
    m.kind = static_cast<MessageKind>(kind);
    const size_t id_nbytes = get<uint16_t>(p + 2);
    m.layer = get<uint32_t>(p + 4);
    m.epoch = get<uint64_t>(p + 8);
    m.ids_hash = get<uint64_t>(p + 16);
    const size_t num_values = get<uint32_t>(p + 24);
    KVMOVE_CHECK(
        id_nbytes >= 1 && id_nbytes <= kMaxRequestIdBytes, Metadata,
        "stream message request id of " << id_nbytes << " bytes, limit 1.." << kMaxRequestIdBytes);
    KVMOVE_CHECK(num_values <= kMaxStreamBlocks, Metadata,
                 "stream message with " << num_values << " values, limit " << kMaxStreamBlocks);
    KVMOVE_CHECK(num_values == 0 || may_carry_values(m.kind), Metadata,
                 message_kind_name(m.kind)
                     << " message carries " << num_values << " values; only Layer and Offer may");
    const size_t head = kFixedBytes + id_nbytes + 8 * num_values;
    KVMOVE_CHECK(head <= nbytes, Metadata,
                 "stream message of " << nbytes << " bytes is too short for its " << id_nbytes
                                      << "-byte request id and " << num_values << " values");
    m.request_id.assign(reinterpret_cast<const char*>(p + kFixedBytes), id_nbytes);
    const uint8_t* values = p + kFixedBytes + id_nbytes;
    if (m.kind == MessageKind::Offer) {
        m.block_ids.resize(num_values);
        for (size_t i = 0; i < num_values; ++i) {
            const uint64_t id = get<uint64_t>(values + 8 * i);
            // Ids are int64 everywhere else; one past that range would not encode back.
            KVMOVE_CHECK(
                id <= uint64_t{std::numeric_limits<int64_t>::max()}, Metadata,
                "Offer of block id " << id << ", limit " << std::numeric_limits<int64_t>::max());
            m.block_ids[i] = static_cast<BlockId>(id);
        }
    } else {
        m.checksums.resize(num_values);
        for (size_t i = 0; i < num_values; ++i) {
            m.checksums[i] = get<uint64_t>(values + 8 * i);
        }
    }
    const size_t rest = nbytes - head;
    KVMOVE_CHECK(rest == 0 || may_carry_payload(m.kind), Metadata,
                 message_kind_name(m.kind) << " message carries " << rest
                                           << " payload bytes; only Final, Refuse and Decline "
                                           << "may");
    KVMOVE_CHECK(rest <= kMaxPayloadBytes, Metadata,
                 message_kind_name(m.kind)
                     << " payload of " << rest << " bytes, limit " << kMaxPayloadBytes);
    m.payload.assign(reinterpret_cast<const char*>(p + head), rest);
    return m;
}

uint64_t hash_ids(const std::vector<BlockId>& ids) {
    std::string bytes;
    bytes.reserve(ids.size() * 8);
    for (BlockId id : ids) {
        put<uint64_t>(bytes, static_cast<uint64_t>(id));
    }
    return xxh64(bytes.data(), bytes.size(), 0);
}

}  // namespace kvmove
