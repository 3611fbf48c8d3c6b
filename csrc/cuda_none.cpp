// The CPU-only build's answers; csrc/cuda/*.cu replace them under KVMOVE_CUDA=1.
#ifndef KVMOVE_WITH_CUDA

#include "cuda_event.h"
#include "cuda_status.h"
#include "errors.h"

namespace kvmove {

CudaStatus cuda_status() {
    return {false, 0, "kvmove was built without CUDA (rebuild with KVMOVE_CUDA=1)"};
}

bool cuda_events_supported() { return false; }

bool cuda_event_done(uintptr_t) {
    KVMOVE_FAIL(Cuda, "kvmove was built without CUDA: it cannot wait for CUDA events "
                      "(rebuild with KVMOVE_CUDA=1)");
}

}  // namespace kvmove

#endif
