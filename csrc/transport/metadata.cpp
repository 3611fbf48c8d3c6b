#include "transport/metadata.h"

#include <cstring>

#include "common/errors.h"
#include "common/hash.h"

namespace kvmove {

namespace {

constexpr char kMagic[4] = {'K', 'V', 'M', 'V'};
constexpr size_t kHeaderBytes = 12;
constexpr size_t kMaxBlobBytes = 1 << 16;

class Writer {
public:
    template <typename T>
    void put(T value) {
        auto p = reinterpret_cast<const uint8_t*>(&value);
        out.insert(out.end(), p, p + sizeof(T));
    }
    template <typename Len>
    void blob(const void* data, size_t nbytes) {
        put(static_cast<Len>(nbytes));
        auto p = static_cast<const uint8_t*>(data);
        out.insert(out.end(), p, p + nbytes);
    }
    std::vector<uint8_t> out;
};

class Reader {
public:
    Reader(const uint8_t* data, size_t nbytes) : p_(data), end_(data + nbytes) {}

    template <typename T>
    T get(const char* field) {
        need(sizeof(T), field);
        T value;
        std::memcpy(&value, p_, sizeof(T));
        p_ += sizeof(T);
        return value;
    }
    template <typename Len>
    std::vector<uint8_t> blob(const char* field, size_t min_nbytes, size_t max_nbytes) {
        size_t nbytes = get<Len>(field);
        KVMOVE_CHECK(nbytes >= min_nbytes && nbytes <= max_nbytes, Metadata,
                     "bad agent metadata: " << field << " is " << nbytes << " bytes, must be in ["
                                            << min_nbytes << ", " << max_nbytes << "]");
        need(nbytes, field);
        std::vector<uint8_t> out(p_, p_ + nbytes);
        p_ += nbytes;
        return out;
    }
    int64_t count(const char* field, int64_t limit = INT32_MAX) {
        auto v = get<uint32_t>(field);
        KVMOVE_CHECK(
            v > 0 && v <= limit, Metadata,
            "bad agent metadata: " << field << " is " << v << ", must be in [1, " << limit << "]");
        return v;
    }
    size_t left() const { return static_cast<size_t>(end_ - p_); }

private:
    void need(size_t nbytes, const char* field) const {
        KVMOVE_CHECK(nbytes <= left(), Metadata,
                     "bad agent metadata: truncated at " << field << " (needs " << nbytes
                                                         << " bytes, " << left() << " left)");
    }
    const uint8_t* p_;
    const uint8_t* end_;
};

std::string text(const std::vector<uint8_t>& bytes, const char* field) {
    std::string out(bytes.begin(), bytes.end());
    size_t bad = first_unprintable(out);
    KVMOVE_CHECK(bad == std::string::npos, Metadata,
                 "bad agent metadata: " << field << " has non-printable byte "
                                        << int(bytes[bad == std::string::npos ? 0 : bad]));
    return out;
}

}  // namespace

size_t first_unprintable(std::string_view text) {
    for (size_t i = 0; i < text.size(); ++i) {
        auto c = static_cast<unsigned char>(text[i]);
        if (c < 0x20 || c >= 0x7f) {
            return i;
        }
    }
    return std::string_view::npos;
}

std::vector<uint8_t> encode(const AgentMetadata& meta) {
    Writer body;
    body.blob<uint8_t>(meta.name.data(), meta.name.size());
    body.put<uint32_t>(meta.incarnation);
    body.put<uint64_t>(meta.started_ns);
    body.blob<uint32_t>(meta.worker_address.data(), meta.worker_address.size());
    body.blob<uint8_t>(meta.host.boot_id.data(), meta.host.boot_id.size());
    body.put<uint64_t>(meta.host.netns_ino);
    body.put<uint64_t>(meta.host.pidns_ino);
    body.put<uint32_t>(meta.host.pid);
    body.put<uint32_t>(static_cast<uint32_t>(meta.segments.size()));
    for (const RemoteSegment& s : meta.segments) {
        body.put<uint64_t>(s.addr);
        body.put<uint64_t>(s.nbytes);
        body.blob<uint32_t>(s.packed_rkey.data(), s.packed_rkey.size());
        body.put<int32_t>(s.memfd);
        body.put<uint64_t>(s.memfd_dev);
        body.put<uint64_t>(s.memfd_ino);
    }
    body.put<uint32_t>(static_cast<uint32_t>(meta.num_layers));
    body.put<uint32_t>(static_cast<uint32_t>(meta.num_blocks));
    body.put<uint32_t>(static_cast<uint32_t>(meta.num_parts));
    for (const Plane& p : meta.planes) {
        body.put<uint64_t>(p.base);
        body.put<uint64_t>(p.block_stride);
        body.put<uint64_t>(p.block_nbytes);
        body.put<uint32_t>(p.segment);
    }
    body.put<uint32_t>(static_cast<uint32_t>(meta.shape.num_kv_heads));
    body.put<uint32_t>(static_cast<uint32_t>(meta.shape.head_dim));
    body.put<uint32_t>(static_cast<uint32_t>(meta.shape.block_size));
    const std::string dtype = dtype_name(meta.shape.dtype);
    body.blob<uint8_t>(dtype.data(), dtype.size());
    const std::string order = order_name(meta.shape.order);
    body.blob<uint8_t>(order.data(), order.size());
    body.put<uint32_t>(static_cast<uint32_t>(meta.shape.head_first));
    body.put<uint32_t>(static_cast<uint32_t>(meta.shape.total_kv_heads));
    Writer out;
    out.out.insert(out.out.end(), kMagic, kMagic + 4);
    out.put<uint16_t>(kMetadataVersion);
    out.put<uint16_t>(0);
    out.blob<uint32_t>(body.out.data(), body.out.size());
    out.put<uint64_t>(xxh64(body.out.data(), body.out.size(), 0));
    return out.out;
}

namespace {

std::vector<uint8_t> checked_body(const std::vector<uint8_t>& bytes) {
    KVMOVE_CHECK(
        bytes.size() >= kHeaderBytes && std::memcmp(bytes.data(), kMagic, 4) == 0, Metadata,
        "bad agent metadata: not kvmove metadata (" << bytes.size() << " bytes, no KVMV magic)");
    Reader header(bytes.data() + 4, bytes.size() - 4);
    auto version = header.get<uint16_t>("version");
    KVMOVE_CHECK(version == kMetadataVersion, Metadata,
                 "bad agent metadata: format version " << version << ", this kvmove reads "
                                                       << kMetadataVersion);
    KVMOVE_CHECK(header.get<uint16_t>("reserved") == 0, Metadata,
                 "bad agent metadata: reserved field is not 0");
    std::vector<uint8_t> body = header.blob<uint32_t>("body", 1, 4 * kMaxBlobBytes);
    auto checksum = header.get<uint64_t>("checksum");
    KVMOVE_CHECK(header.left() == 0, Metadata,
                 "bad agent metadata: " << header.left() << " bytes after the checksum");
    KVMOVE_CHECK(checksum == xxh64(body.data(), body.size(), 0), Metadata,
                 "bad agent metadata: checksum mismatch (corrupted in transit?)");
    return body;
}

void read_segments(Reader& r, AgentMetadata& m) {
    const int64_t num = r.count("num_segments", kMaxMetadataSegments);
    for (int64_t i = 0; i < num; ++i) {
        RemoteSegment s;
        s.addr = r.get<uint64_t>("segment addr");
        s.nbytes = r.get<uint64_t>("segment nbytes");
        uint64_t end = 0;
        KVMOVE_CHECK(s.nbytes > 0 && !__builtin_add_overflow(s.addr, s.nbytes, &end), Metadata,
                     "bad agent metadata: segment " << i << " of " << s.nbytes << " bytes at 0x"
                                                    << std::hex << s.addr
                                                    << " is empty or overflows 64 bits");
        s.packed_rkey = r.blob<uint32_t>("packed_rkey", 1, kMaxBlobBytes);
        s.memfd = r.get<int32_t>("segment memfd");
        s.memfd_dev = r.get<uint64_t>("segment memfd_dev");
        s.memfd_ino = r.get<uint64_t>("segment memfd_ino");
        KVMOVE_CHECK(s.memfd >= 0 || (s.memfd == -1 && s.memfd_dev == 0 && s.memfd_ino == 0),
                     Metadata,
                     "bad agent metadata: segment " << i << " has memfd " << s.memfd
                                                    << " (must be -1, with dev and ino 0, or "
                                                    << "a file descriptor)");
        m.segments.push_back(std::move(s));
    }
}

void read_host(Reader& r, AgentMetadata& m) {
    m.host.boot_id = text(r.blob<uint8_t>("boot_id", 0, kMaxBootIdBytes), "boot_id");
    m.host.netns_ino = r.get<uint64_t>("netns_ino");
    m.host.pidns_ino = r.get<uint64_t>("pidns_ino");
    m.host.pid = r.get<uint32_t>("pid");
}

void read_planes(Reader& r, AgentMetadata& m) {
    m.num_layers = r.count("num_layers", kMaxMetadataLayers);
    m.num_blocks = r.count("num_blocks");
    m.num_parts = r.count("num_parts", 2);
    for (int64_t i = 0; i < m.num_layers * m.num_parts; ++i) {
        Plane p;
        p.base = r.get<uint64_t>("plane base");
        p.block_stride = r.get<uint64_t>("plane block_stride");
        p.block_nbytes = r.get<uint64_t>("plane block_nbytes");
        p.segment = r.get<uint32_t>("plane segment");
        m.planes.push_back(p);
    }
}

void read_shape(Reader& r, AgentMetadata& m) {
    m.shape.num_kv_heads = static_cast<int32_t>(r.count("num_kv_heads"));
    m.shape.head_dim = static_cast<int32_t>(r.count("head_dim"));
    m.shape.block_size = static_cast<int32_t>(r.count("block_size"));
    const std::string dtype = text(r.blob<uint8_t>("dtype", 1, 32), "dtype");
    KVMOVE_CHECK(parse_dtype(dtype, m.shape.dtype), Metadata,
                 "bad agent metadata: unknown dtype '" << dtype << "'");
    const std::string order = text(r.blob<uint8_t>("order", 1, 32), "order");
    KVMOVE_CHECK(parse_order(order, m.shape.order), Metadata,
                 "bad agent metadata: unknown order '" << order << "'");
    const int64_t head_first = r.get<uint32_t>("head_first");
    m.shape.total_kv_heads = static_cast<int32_t>(r.count("total_kv_heads"));
    KVMOVE_CHECK(head_first + m.shape.num_kv_heads <= m.shape.total_kv_heads, Metadata,
                 "bad agent metadata: KV heads ["
                     << head_first << ", " << head_first + m.shape.num_kv_heads
                     << ") are not among total_kv_heads " << m.shape.total_kv_heads);
    m.shape.head_first = static_cast<int32_t>(head_first);
}

// The planes form a geometry, lie in their segments, and hold blocks of the shape's size.
void check_geometry(const AgentMetadata& m) {
    std::vector<Descriptor> spans;
    for (const RemoteSegment& s : m.segments) {
        spans.push_back({s.addr, s.nbytes});
    }
    std::string outside;
    uint64_t block_nbytes = 0;
    try {
        const KVGeometry g = m.geometry();
        outside = outside_segments(g, spans);
        block_nbytes = g.block_nbytes();
    } catch (const Error& e) {
        KVMOVE_FAIL(Metadata, "bad agent metadata: " << e.what());
    }
    KVMOVE_CHECK(outside.empty(), Metadata, "bad agent metadata: " << outside);
    KVMOVE_CHECK(block_nbytes == m.shape.nbytes(), Metadata,
                 "bad agent metadata: planes hold " << block_nbytes << " B per block and layer, "
                                                    << "the shape " << m.shape.nbytes());
}

}  // namespace

AgentMetadata decode(const std::vector<uint8_t>& bytes) {
    const std::vector<uint8_t> body = checked_body(bytes);
    Reader r(body.data(), body.size());
    AgentMetadata m;
    m.name = text(r.blob<uint8_t>("name", 1, kMaxAgentNameBytes), "name");
    m.incarnation = r.get<uint32_t>("incarnation");
    m.started_ns = r.get<uint64_t>("started_ns");
    KVMOVE_CHECK(m.incarnation != 0, Metadata, "bad agent metadata: incarnation is 0");
    m.worker_address = r.blob<uint32_t>("worker_address", 1, kMaxBlobBytes);
    read_host(r, m);
    read_segments(r, m);
    read_planes(r, m);
    read_shape(r, m);
    KVMOVE_CHECK(r.left() == 0, Metadata, "bad agent metadata: " << r.left() << " trailing bytes");
    check_geometry(m);
    return m;
}

}  // namespace kvmove
