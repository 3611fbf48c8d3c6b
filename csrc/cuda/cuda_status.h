// What CUDA the running process can use: built in or not, a driver, how many devices.
#pragma once

#include <string>

namespace kvmove {

struct CudaStatus {
    bool built;          // compiled with KVMOVE_CUDA=1
    int device_count;    // 0 unless built and a driver sees devices
    std::string reason;  // why device_count is 0, empty otherwise
};

// Never throws: a machine without a driver is a status, not an error.
CudaStatus cuda_status();

#ifndef KVMOVE_WITH_CUDA
// A CPU-only build asked to `what` (e.g. "copy device memory"): throws CudaError saying so.
[[noreturn]] void no_cuda(const char* what);
#endif

}  // namespace kvmove
