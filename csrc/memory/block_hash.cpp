#include "memory/block_hash.h"

#include <cstring>

#include "common/errors.h"

namespace kvmove {

std::vector<uint64_t> block_hashes(const int64_t* tokens, size_t num_tokens, int64_t block_size,
                                   std::optional<uint64_t> parent, uint64_t seed) {
    KVMOVE_CHECK(block_size > 0, Config, "block_size must be positive, got " << block_size);
    const size_t per_block = static_cast<size_t>(block_size);
    std::vector<int64_t> buffer(per_block + 1);
    std::vector<uint64_t> out;
    out.reserve(num_tokens / per_block);
    uint64_t prev = parent.value_or(0);
    for (size_t start = 0; start + per_block <= num_tokens; start += per_block) {
        buffer[0] = static_cast<int64_t>(prev);
        std::memcpy(buffer.data() + 1, tokens + start, per_block * sizeof(int64_t));
        prev = xxh64(buffer.data(), buffer.size() * sizeof(int64_t), seed);
        out.push_back(prev);
    }
    return out;
}

}  // namespace kvmove
