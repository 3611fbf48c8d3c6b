// cuda_status() for the CUDA build. cudart is linked statically, so this runs (and answers
// "no driver") on machines without one instead of failing at import.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/cuda_status.h"

namespace kvmove {

CudaStatus cuda_status() {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        return {true, 0, std::string("no usable CUDA device: ") + cudaGetErrorString(err)};
    }
    if (count == 0) {
        return {true, 0, "the CUDA driver reports no devices"};
    }
    return {true, count, ""};
}

}  // namespace kvmove
