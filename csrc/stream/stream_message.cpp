#include "stream/stream_message.h"

#include <cstring>

#include "common/errors.h"
#include "common/xxh64.h"

namespace kvmove {

namespace {

constexpr size_t kFixedBytes = 1 + 1 + 2 + 4 + 8 + 8;

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

}  // namespace

std::string encode(const StreamMessage& m) {
    std::string out;
    out.reserve(kFixedBytes + m.request_id.size() + m.payload.size());
    put<uint8_t>(out, kStreamMessageVersion);
    put<uint8_t>(out, static_cast<uint8_t>(m.kind));
    put<uint16_t>(out, static_cast<uint16_t>(m.request_id.size()));
    put<uint32_t>(out, static_cast<uint32_t>(m.layer));
    put<uint64_t>(out, m.ids_hash);
    put<uint64_t>(out, m.serial);
    out += m.request_id;
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
    StreamMessage m;
    uint8_t kind = p[1];
    KVMOVE_CHECK(kind >= 1 && kind <= 4, Metadata, "unknown stream message kind " << int(kind));
    m.kind = static_cast<MessageKind>(kind);
    size_t id_nbytes = get<uint16_t>(p + 2);
    m.layer = static_cast<int32_t>(get<uint32_t>(p + 4));
    m.ids_hash = get<uint64_t>(p + 8);
    m.serial = get<uint64_t>(p + 16);
    KVMOVE_CHECK(
        id_nbytes >= 1 && id_nbytes <= kMaxRequestIdBytes, Metadata,
        "stream message request id of " << id_nbytes << " bytes, limit 1.." << kMaxRequestIdBytes);
    KVMOVE_CHECK(kFixedBytes + id_nbytes <= nbytes, Metadata,
                 "stream message of " << nbytes << " bytes is too short for its " << id_nbytes
                                      << "-byte request id");
    m.request_id.assign(reinterpret_cast<const char*>(p + kFixedBytes), id_nbytes);
    size_t rest = nbytes - kFixedBytes - id_nbytes;
    KVMOVE_CHECK(rest == 0 || m.kind == MessageKind::Final, Metadata,
                 "stream message kind " << int(kind) << " carries " << rest
                                        << " payload bytes; only Final may");
    m.payload.assign(reinterpret_cast<const char*>(p + kFixedBytes + id_nbytes), rest);
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
