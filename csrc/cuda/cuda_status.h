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

}  // namespace kvmove
