#include "common/xxh64.h"

#include <cstring>

namespace kvmove {

namespace {

// XXH64 as specified in xxHash's doc/xxhash_spec.md (little-endian hosts only, as every
// platform kvmove targets).
constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

inline uint64_t rotl(uint64_t x, int r) {
    return (x << r) | (x >> (64 - r));
}

inline uint64_t load64(const unsigned char* p) {
    uint64_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline uint32_t load32(const unsigned char* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline uint64_t xx_round(uint64_t acc, uint64_t lane) {
    return rotl(acc + lane * kPrime2, 31) * kPrime1;
}

inline uint64_t merge(uint64_t acc, uint64_t v) {
    return (acc ^ xx_round(0, v)) * kPrime1 + kPrime4;
}

uint64_t stripes(const unsigned char*& p, const unsigned char* end, uint64_t seed) {
    uint64_t v1 = seed + kPrime1 + kPrime2, v2 = seed + kPrime2, v3 = seed, v4 = seed - kPrime1;
    for (; end - p >= 32; p += 32) {
        v1 = xx_round(v1, load64(p));
        v2 = xx_round(v2, load64(p + 8));
        v3 = xx_round(v3, load64(p + 16));
        v4 = xx_round(v4, load64(p + 24));
    }
    uint64_t acc = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    return merge(merge(merge(merge(acc, v1), v2), v3), v4);
}

}  // namespace

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed) {
    auto p = static_cast<const unsigned char*>(data);
    const unsigned char* end = p + nbytes;
    uint64_t acc = nbytes >= 32 ? stripes(p, end, seed) : seed + kPrime5;
    acc += nbytes;
    for (; end - p >= 8; p += 8) {
        acc = rotl(acc ^ xx_round(0, load64(p)), 27) * kPrime1 + kPrime4;
    }
    if (end - p >= 4) {
        acc = rotl(acc ^ (load32(p) * kPrime1), 23) * kPrime2 + kPrime3;
        p += 4;
    }
    for (; p < end; ++p) {
        acc = rotl(acc ^ (*p * kPrime5), 11) * kPrime1;
    }
    acc ^= acc >> 33;
    acc *= kPrime2;
    acc ^= acc >> 29;
    acc *= kPrime3;
    return acc ^ (acc >> 32);
}

}  // namespace kvmove
