// The CPU-only build's answer; csrc/cuda/cuda_status.cu replaces it under KVMOVE_CUDA=1.
#ifndef KVMOVE_WITH_CUDA

#include "cuda_status.h"

namespace kvmove {

CudaStatus cuda_status() {
    return {false, 0, "kvmove was built without CUDA (rebuild with KVMOVE_CUDA=1)"};
}

}  // namespace kvmove

#endif
