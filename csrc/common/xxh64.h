// XXH64: the 64-bit xxHash of a byte range (the published algorithm and its test vectors).
//
// kvmove's one non-cryptographic hash: block content hashes (memory/block_hash.h), metadata
// and stream-message checksums, the disk tier's per-block checksums. Why XXH64 is the right
// trade there: memory/block_hash.h.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvmove {

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed);

}  // namespace kvmove
