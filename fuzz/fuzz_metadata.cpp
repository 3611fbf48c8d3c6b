// libFuzzer target: agent metadata (csrc/transport/metadata.h), the bytes a peer sends before
// anything else. Whatever the input, decode() returns or throws kvmove::Error; a blob it
// accepts encodes back to exactly itself (one encoding per value: nothing the decoder let
// through was ignored).
//
// The custom mutator is the review's "forged" strategy: after libFuzzer's own mutation it
// often repairs the framing (magic, version, body length) and recomputes the checksum, so
// mutations reach the field checks instead of dying at the checksum, as a forger's would.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/errors.h"
#include "common/hash.h"
#include "transport/metadata.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace {

constexpr size_t kHeader = 12;
constexpr size_t kChecksum = 8;

void put_u32(uint8_t* p, uint32_t v) {
    std::memcpy(p, &v, sizeof v);
}

}  // namespace

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
    size = LLVMFuzzerMutate(data, size, max_size);
    if (seed % 4 == 0 || size < kHeader + kChecksum) {
        return size;  // a quarter stay as mutated: the framing checks need inputs too
    }
    std::memcpy(data, "KVMV", 4);
    const uint16_t version = kvmove::kMetadataVersion;
    std::memcpy(data + 4, &version, sizeof version);
    if (seed % 8 != 1) {
        data[6] = data[7] = 0;  // the reserved field
    }
    const size_t body = size - kHeader - kChecksum;
    put_u32(data + 8, static_cast<uint32_t>(body));
    const uint64_t sum = kvmove::xxh64(data + kHeader, body, 0);
    std::memcpy(data + kHeader + body, &sum, sizeof sum);
    return size;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::vector<uint8_t> blob(data, data + size);
    kvmove::AgentMetadata meta;
    try {
        meta = kvmove::decode(blob);
    } catch (const kvmove::Error&) {
        return 0;
    }
    if (kvmove::encode(meta) != blob) {
        std::abort();  // accepted, but not as it would be written
    }
    return 0;
}
