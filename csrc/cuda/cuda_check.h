// KVMOVE_CUDA_CHECK(expr, "context " << value): throws CudaError naming the call, the CUDA
// error string and file:line unless expr returns cudaSuccess (the last error is reset; a
// sticky error, which poisons the context, cannot be).
#pragma once

#include <cuda_runtime_api.h>

#include "common/errors.h"

#define KVMOVE_CUDA_CHECK(expr, stream_expr)                                                       \
    do {                                                                                           \
        cudaError_t kvmove_err_ = (expr);                                                          \
        if (kvmove_err_ != cudaSuccess) {                                                          \
            cudaGetLastError();                                                                    \
            KVMOVE_FAIL(Cuda,                                                                      \
                        stream_expr << ": " #expr " failed: " << cudaGetErrorString(kvmove_err_)); \
        }                                                                                          \
    } while (0)
