#include "stream/stream_message.h"

#include <cstring>

#include "common/errors.h"
#include "common/xxh64.h"

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
    return kind == MessageKind::Final || kind == MessageKind::Refuse;
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
    }
    return "unknown";
}

std::string encode(const StreamMessage& m) {
    std::string out;
    out.reserve(kFixedBytes + m.request_id.size() + 8 * m.checksums.size() + m.payload.size());
    put<uint8_t>(out, kStreamMessageVersion);
    put<uint8_t>(out, static_cast<uint8_t>(m.kind));
    put<uint16_t>(out, static_cast<uint16_t>(m.request_id.size()));
    put<uint32_t>(out, m.layer);
    put<uint64_t>(out, m.epoch);
    put<uint64_t>(out, m.ids_hash);
    put<uint32_t>(out, static_cast<uint32_t>(m.checksums.size()));
    out += m.request_id;
    for (uint64_t c : m.checksums) {
        put<uint64_t>(out, c);
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
    KVMOVE_CHECK(kind >= 1 && kind <= 8, Metadata, "unknown stream message kind " << int(kind));
    StreamMessage m;
    m.kind = static_cast<MessageKind>(kind);
    const size_t id_nbytes = get<uint16_t>(p + 2);
    m.layer = get<uint32_t>(p + 4);
    m.epoch = get<uint64_t>(p + 8);
    m.ids_hash = get<uint64_t>(p + 16);
    const size_t num_checksums = get<uint32_t>(p + 24);
    KVMOVE_CHECK(id_nbytes >= 1 && id_nbytes <= kMaxRequestIdBytes, Metadata,
                 "stream message request id of " << id_nbytes << " bytes, limit 1.."
                                                 << kMaxRequestIdBytes);
    KVMOVE_CHECK(num_checksums <= kMaxChecksums, Metadata,
                 "stream message with " << num_checksums << " checksums, limit "
                                        << kMaxChecksums);
    KVMOVE_CHECK(num_checksums == 0 || m.kind == MessageKind::Layer, Metadata,
                 message_kind_name(m.kind) << " message carries " << num_checksums
                                           << " checksums; only Layer may");
    const size_t head = kFixedBytes + id_nbytes + 8 * num_checksums;
    KVMOVE_CHECK(head <= nbytes, Metadata,
                 "stream message of " << nbytes << " bytes is too short for its " << id_nbytes
                                      << "-byte request id and " << num_checksums
                                      << " checksums");
    m.request_id.assign(reinterpret_cast<const char*>(p + kFixedBytes), id_nbytes);
    m.checksums.resize(num_checksums);
    for (size_t i = 0; i < num_checksums; ++i) {
        m.checksums[i] = get<uint64_t>(p + kFixedBytes + id_nbytes + 8 * i);
    }
    const size_t rest = nbytes - head;
    KVMOVE_CHECK(rest == 0 || may_carry_payload(m.kind), Metadata,
                 message_kind_name(m.kind) << " message carries " << rest
                                           << " payload bytes; only Final and Refuse may");
    KVMOVE_CHECK(rest <= kMaxPayloadBytes, Metadata,
                 message_kind_name(m.kind) << " payload of " << rest << " bytes, limit "
                                           << kMaxPayloadBytes);
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
