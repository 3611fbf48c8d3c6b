// Polling CUDA events for the CUDA build (see cuda/cuda_event.h).
#include <cuda_runtime_api.h>

#include "common/errors.h"
#include "cuda/cuda_event.h"

namespace kvmove {

bool cuda_events_supported() {
    return true;
}

bool cuda_event_done(uintptr_t event) {
    KVMOVE_CHECK(event != 0, Cuda, "CUDA event handle is null");
    cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
    if (err == cudaSuccess) {
        return true;
    }
    if (err == cudaErrorNotReady) {
        return false;
    }
    cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
    KVMOVE_FAIL(
        Cuda, "waiting for CUDA event 0x" << std::hex << event << ": " << cudaGetErrorString(err));
}

}  // namespace kvmove
