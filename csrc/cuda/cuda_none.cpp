// The CPU-only build's answers; csrc/cuda/*.cu replace them under KVMOVE_CUDA=1 (the
// kernels' own: convert/kv_kernels_none.cpp).
#ifndef KVMOVE_WITH_CUDA

#include "common/errors.h"
#include "cuda/cuda_event.h"
#include "cuda/cuda_memory.h"
#include "cuda/cuda_status.h"

namespace kvmove {

CudaStatus cuda_status() {
    return {false, 0, "kvmove was built without CUDA (rebuild with KVMOVE_CUDA=1)"};
}

bool cuda_events_supported() {
    return false;
}

bool cuda_event_done(uintptr_t) {
    KVMOVE_FAIL(Cuda,
                "kvmove was built without CUDA: it cannot wait for CUDA events "
                "(rebuild with KVMOVE_CUDA=1)");
}

void no_cuda(const char* what) {
    KVMOVE_FAIL(Cuda, "kvmove was built without CUDA: it cannot "
                          << what << " (rebuild with KVMOVE_CUDA=1)");
}

void* cuda_alloc(int device, uint64_t nbytes) {
    (void)device;
    (void)nbytes;
    no_cuda("allocate device memory");
}

void cuda_free(int, void*) noexcept {}

bool cuda_pin(void*, uint64_t) {
    return false;
}

void cuda_unpin(void*) noexcept {}

void cuda_copy(void*, const void*, uint64_t) {
    no_cuda("copy device memory");
}

void cuda_synchronize(int) {
    no_cuda("synchronize a device");
}

}  // namespace kvmove

#endif
