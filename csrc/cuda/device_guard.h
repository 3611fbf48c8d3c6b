// DeviceGuard: makes a device current for a scope and restores the thread's previous one
// (torch and kvmove share the runtime's per-thread current device).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/cuda_check.h"

namespace kvmove {

class DeviceGuard {
public:
    explicit DeviceGuard(int device) {
        KVMOVE_CUDA_CHECK(cudaGetDevice(&previous_), "cannot read the current CUDA device");
        KVMOVE_CUDA_CHECK(cudaSetDevice(device), "cannot use CUDA device " << device);
    }
    ~DeviceGuard() { cudaSetDevice(previous_); }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

private:
    int previous_ = 0;
};

}  // namespace kvmove
