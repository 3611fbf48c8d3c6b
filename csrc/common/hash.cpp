#include "common/hash.h"

// The whole library in this one translation unit, its functions static: nothing of it is
// exported from kvmove's module.
#define XXH_INLINE_ALL
#include "xxhash.h"

namespace kvmove {

static_assert(sizeof(XXH3_state_t) == sizeof(Xxh3), "Xxh3's state has XXH3_state_t's size");
static_assert(alignof(XXH3_state_t) <= 64, "Xxh3's state is aligned for XXH3_state_t");

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed) {
    return XXH64(data, nbytes, seed);
}

uint64_t xxh3(const void* data, size_t nbytes, uint64_t seed) {
    return XXH3_64bits_withSeed(data, nbytes, seed);
}

namespace {

XXH3_state_t* as_state(unsigned char* bytes) {
    return reinterpret_cast<XXH3_state_t*>(bytes);
}

}  // namespace

Xxh3::Xxh3(uint64_t seed) {
    XXH3_state_t* state = as_state(state_);
    XXH3_INITSTATE(state);
    XXH3_64bits_reset_withSeed(state, seed);
}

void Xxh3::update(const void* data, size_t nbytes) {
    XXH3_64bits_update(as_state(state_), data, nbytes);
}

uint64_t Xxh3::digest() const {
    return XXH3_64bits_digest(reinterpret_cast<const XXH3_state_t*>(state_));
}

}  // namespace kvmove
