// Device and pinned memory for the CUDA build (see csrc/cuda_memory.h).
#include <cuda_runtime_api.h>

#include "cuda/cuda_check.h"
#include "cuda_memory.h"

namespace kvmove {

void* cuda_alloc(int device, uint64_t nbytes) {
    KVMOVE_CUDA_CHECK(cudaSetDevice(device), "cannot use CUDA device " << device);
    void* p = nullptr;
    KVMOVE_CUDA_CHECK(cudaMalloc(&p, nbytes),
                      "cannot allocate " << nbytes << " bytes on CUDA device " << device);
    cudaError_t err = cudaMemset(p, 0, nbytes);
    if (err != cudaSuccess) {
        cudaFree(p);
        KVMOVE_CUDA_CHECK(err, "cannot zero " << nbytes << " bytes on CUDA device " << device);
    }
    return p;
}

void cuda_free(int device, void* p) noexcept {
    cudaSetDevice(device);
    cudaFree(p);
}

bool cuda_pin(void* p, uint64_t nbytes) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        return false;
    }
    KVMOVE_CUDA_CHECK(cudaHostRegister(p, nbytes, cudaHostRegisterDefault),
                      "cannot pin " << nbytes << " bytes of host memory");
    return true;
}

void cuda_unpin(void* p) noexcept { cudaHostUnregister(p); }

void cuda_copy(void* dst, const void* src, uint64_t nbytes) {
    KVMOVE_CUDA_CHECK(cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault),
                      "cannot copy " << nbytes << " bytes");
}

}  // namespace kvmove
