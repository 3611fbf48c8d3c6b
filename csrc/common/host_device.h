// KVMOVE_HD: a small inline function that host code and CUDA kernels both call, so the two
// compute the same thing from one definition (addresses, element indexes, dtype conversions).
#pragma once

#ifdef __CUDACC__
#define KVMOVE_HD __host__ __device__ inline
#else
#define KVMOVE_HD inline
#endif
