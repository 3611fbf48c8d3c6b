// Device and pinned memory for the CUDA build (see cuda/cuda_memory.h).
#include <cuda_runtime_api.h>

#include "cuda/cuda_check.h"
#include "cuda/cuda_memory.h"
#include "cuda/device_guard.h"

namespace kvmove {

void* cuda_alloc(int device, uint64_t nbytes) {
    DeviceGuard guard(device);
    void* p = nullptr;
    KVMOVE_CUDA_CHECK(cudaMalloc(&p, nbytes),
                      "cannot allocate " << nbytes << " bytes on CUDA device " << device);
    cudaError_t err = cudaMemset(p, 0, nbytes);
    if (err == cudaSuccess) {
        err = cudaDeviceSynchronize();  // zeroed before anyone (a peer, torch) can write it
    }
    if (err != cudaSuccess) {
        cudaFree(p);
        KVMOVE_CUDA_CHECK(err, "cannot zero " << nbytes << " bytes on CUDA device " << device);
    }
    return p;
}

void cuda_free(int device, void* p) noexcept {
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
        cudaGetLastError();
        return;  // no usable device left: the process is going down
    }
    cudaFree(p);
    cudaSetDevice(previous);
}

bool cuda_pin(void* p, uint64_t nbytes) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 ||
        cudaHostRegister(p, nbytes, cudaHostRegisterDefault) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return true;
}

void cuda_unpin(void* p) noexcept {
    cudaHostUnregister(p);
}

void cuda_copy(void* dst, const void* src, uint64_t nbytes) {
    KVMOVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, 0),
                      "cannot copy " << nbytes << " bytes");
}

void cuda_synchronize(int device) {
    DeviceGuard guard(device);
    KVMOVE_CUDA_CHECK(cudaDeviceSynchronize(), "CUDA device " << device << " failed");
}

}  // namespace kvmove
