// The CPU-only build's device halves of pack/unpack and convert: kv_kernels.cu replaces them
// under KVMOVE_CUDA=1.
#ifndef KVMOVE_WITH_CUDA

#include "convert/kv_convert.h"
#include "cuda/cuda_status.h"

namespace kvmove {

void pack_blocks_cuda(const CacheView&, const std::vector<int64_t>&, char*, bool) {
    no_cuda("pack device blocks");
}

void convert_blocks_cuda(const ConvertPlan&) {
    no_cuda("convert device blocks");
}

}  // namespace kvmove

#endif
