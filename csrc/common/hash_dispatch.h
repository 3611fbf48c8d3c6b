// The AVX2 build of XXH3 (hash_avx2.cpp), which hash.cpp calls where the CPU has AVX2. GCC
// only: the build selects it with GCC's target pragma (clang, as the fuzz targets' compiler,
// keeps the SSE2 build alone).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVMOVE_XXH3_AVX2 1

namespace kvmove::avx2 {

uint64_t xxh3(const void* data, size_t nbytes, uint64_t seed);
// XXH3_64bits_update on an XXH3_state_t (the same layout in both builds).
void xxh3_update(void* state, const void* data, size_t nbytes);

}  // namespace kvmove::avx2
#endif
