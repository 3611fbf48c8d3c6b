// kvmove's non-cryptographic hashes, both from the xxHash library (third_party/xxhash, 0.8.4):
//
//   xxh64: block content hashes (memory/block_hash.h), agent metadata and stream-message ids
//          (small inputs, values that must not change between releases: they name blocks);
//   xxh3:  per-block checksums of KV bytes (stream layers, host and disk tiers): XXH3 runs
//          at memory speed with SIMD where XXH64 is scalar, which is what lets checksums stay
//          on by default.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvmove {

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed);
uint64_t xxh3(const void* data, size_t nbytes, uint64_t seed);

// XXH3 of several byte ranges read as one (a block whose parts lie apart): update() each
// range in order, then digest(). Equal to xxh3() of the ranges' concatenation.
class Xxh3 {
public:
    explicit Xxh3(uint64_t seed);
    void update(const void* data, size_t nbytes);
    uint64_t digest() const;

private:
    alignas(64) unsigned char state_[576];  // XXH3_state_t (hash.cpp checks size and alignment)
};

}  // namespace kvmove
