#include "common/hash.h"

// The whole library in this one translation unit, its functions static: nothing of it is
// exported from kvmove's module.
#define XXH_INLINE_ALL
#include "common/hash_dispatch.h"
#include "xxhash.h"

namespace kvmove {

namespace {

#ifdef KVMOVE_XXH3_AVX2
const bool kAvx2 = [] {
    __builtin_cpu_init();  // before the first constructors' use of it too
    return __builtin_cpu_supports("avx2") != 0;
}();
#else
constexpr bool kAvx2 = false;
#endif

}  // namespace

static_assert(sizeof(XXH3_state_t) == sizeof(Xxh3), "Xxh3's state has XXH3_state_t's size");
static_assert(alignof(XXH3_state_t) <= 64, "Xxh3's state is aligned for XXH3_state_t");

uint64_t xxh64(const void* data, size_t nbytes, uint64_t seed) {
    return XXH64(data, nbytes, seed);
}

uint64_t xxh3(const void* data, size_t nbytes, uint64_t seed) {
#ifdef KVMOVE_XXH3_AVX2
    if (kAvx2) {
        return avx2::xxh3(data, nbytes, seed);
    }
#endif
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
#ifdef KVMOVE_XXH3_AVX2
    if (kAvx2) {
        avx2::xxh3_update(state_, data, nbytes);
        return;
    }
#endif
    XXH3_64bits_update(as_state(state_), data, nbytes);
}

uint64_t Xxh3::digest() const {
    return XXH3_64bits_digest(reinterpret_cast<const XXH3_state_t*>(state_));
}

}  // namespace kvmove
