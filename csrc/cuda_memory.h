// Device and pinned memory as the core uses it: allocate, free, pin, copy. One place that
// knows the CUDA runtime; csrc/cuda/cuda_memory.cu implements it under KVMOVE_CUDA=1 and
// csrc/cuda_none.cpp says "built without CUDA" otherwise.
#pragma once

#include <cstdint>

namespace kvmove {

// nbytes of zero-filled memory on device; throws CudaError (no CUDA, no device, no memory).
void* cuda_alloc(int device, uint64_t nbytes);
void cuda_free(int device, void* p) noexcept;
// Page-locks host memory (cudaHostRegister) so copies to and from devices are DMA at full
// speed. False, and nothing done, where this build or this machine has no CUDA device.
bool cuda_pin(void* p, uint64_t nbytes);
void cuda_unpin(void* p) noexcept;
// cudaMemcpy in whichever direction the pointers say (unified addressing); synchronous.
void cuda_copy(void* dst, const void* src, uint64_t nbytes);

}  // namespace kvmove
