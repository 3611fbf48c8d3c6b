// Device and pinned memory as the core uses it: allocate, free, pin, copy, synchronize. One
// place that knows the CUDA runtime; csrc/cuda/cuda_memory.cu implements it under
// KVMOVE_CUDA=1 and csrc/cuda/cuda_none.cpp says "built without CUDA" otherwise.
//
// Ordering: kvmove's device work runs on the legacy default stream, which does not order
// against non-blocking streams (torch's side streams, CUDA graphs, UCX's own). So every call
// that touches device memory starts with cuda_synchronize(device) (what any stream wrote before
// the call is there) and ends with it (what the call wrote is there before it returns).
#pragma once

#include <cstdint>

namespace kvmove {

// nbytes of zero-filled memory on device, the zeroing finished; throws CudaError (no CUDA, no
// device, no memory). The calling thread's current device is left as it was.
void* cuda_alloc(int device, uint64_t nbytes);
void cuda_free(int device, void* p) noexcept;
// Page-locks host memory (cudaHostRegister) so copies to and from devices are DMA at full
// speed. False, and nothing done, where this build or this machine has no CUDA device, or the
// driver refuses.
bool cuda_pin(void* p, uint64_t nbytes);
void cuda_unpin(void* p) noexcept;
// cudaMemcpyAsync on the legacy default stream, either direction (unified addressing); the
// caller synchronizes (cuda_synchronize) before reading the result.
void cuda_copy(void* dst, const void* src, uint64_t nbytes);
// Waits for all work on device (every stream).
void cuda_synchronize(int device);

}  // namespace kvmove
