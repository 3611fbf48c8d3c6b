// The device halves of pack/unpack and convert (see kv_convert.h). Element math is
// kv_convert_math.h's, shared with the host path, so both give the same bits.
//
// A call makes the cache's device current, waits for the device (so what torch or anyone wrote
// on any stream is there: the legacy default stream does not order against non-blocking
// ones), launches on the legacy default stream and waits again before returning: synchronous
// like its host twin.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "convert/kv_convert.h"
#include "cuda/cuda_check.h"
#include "cuda/device_guard.h"

namespace kvmove {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;

// A host vector (ids, planes) copied to the device for one launch; freed when it goes out of
// scope.
template <typename T>
class DeviceArray {
public:
    explicit DeviceArray(const std::vector<T>& values) {
        void* raw = nullptr;
        KVMOVE_CUDA_CHECK(cudaMalloc(&raw, values.size() * sizeof(T) + 1),
                          "cannot allocate " << values.size() << " values on the device");
        data_ = static_cast<T*>(raw);
        cudaError_t err =
            cudaMemcpy(data_, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice);
        if (err != cudaSuccess) {
            cudaFree(data_);
            KVMOVE_CUDA_CHECK(err, "cannot copy " << values.size() << " values to the device");
        }
    }
    ~DeviceArray() { cudaFree(data_); }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    const T* get() const { return data_; }

private:
    T* data_ = nullptr;
};

int grid_for(int64_t jobs) {
    return static_cast<int>(jobs < 1 ? 1 : (jobs < kMaxGrid ? jobs : kMaxGrid));
}

// One thread block per (layer, block) job: 16-byte vector copies when everything is aligned.
// planes[li] is the li-th selected layer's.
__global__ void pack_kernel(const Plane* planes, int64_t num_layers, const int64_t* ids,
                            int64_t num_ids, uint64_t block_nbytes, char* staging, bool unpack,
                            bool vector) {
    for (int64_t job = blockIdx.x; job < num_ids * num_layers; job += gridDim.x) {
        char* block =
            reinterpret_cast<char*>(block_address(planes[job / num_ids], ids[job % num_ids]));
        char* stage = staging + job * block_nbytes;
        char* from = unpack ? stage : block;
        char* to = unpack ? block : stage;
        if (vector) {
            const uint64_t n = block_nbytes / 16;
            for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) {
                reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
            }
        } else {
            for (uint64_t i = threadIdx.x; i < block_nbytes; i += blockDim.x) {
                to[i] = from[i];
            }
        }
    }
}

struct ConvertArgs {
    const Plane* src_planes;  // K and V of each selected layer, [2 * li + kv], on the device
    const Plane* dst_planes;
    BlockShape src_shape;
    BlockShape dst_shape;
    const int64_t* src_ids;
    const int64_t* dst_ids;
    int64_t num_src_ids;
    int64_t num_dst_ids;
    int64_t num_layers;
    int64_t num_tokens;
    HeadSpan heads;
    float* scales;
};

__device__ float convert_value(const ConvertArgs& a, int64_t li, int kv, int64_t t, int h, int x) {
    const BlockShape& s = a.src_shape;
    const int64_t sb = t / s.block_size;
    const char* block =
        reinterpret_cast<const char*>(block_address(a.src_planes[2 * li + kv], a.src_ids[sb]));
    const float scale =
        s.dtype == DType::Float8 ? a.scales[(li * a.num_src_ids + sb) * 2 + kv] : 1.0f;
    return load_element(
               block, s.dtype,
               element_index(s, 0, static_cast<int>(t % s.block_size), a.heads.src_first + h, x)) *
           scale;
}

// One thread block per (layer, destination block, K or V): the block's amax first when the
// destination is float8 (a shared-memory max reduction), then every element.
__global__ void convert_kernel(ConvertArgs a) {
    __shared__ float partial[kThreads];
    const BlockShape& d = a.dst_shape;
    const int64_t jobs = a.num_layers * a.num_dst_ids * 2;
    for (int64_t job = blockIdx.x; job < jobs; job += gridDim.x) {
        const int kv = static_cast<int>(job % 2);
        const int64_t bi = (job / 2) % a.num_dst_ids;
        const int64_t li = job / 2 / a.num_dst_ids;
        const int64_t first = bi * d.block_size;
        const int64_t left = a.num_tokens - first;
        const int64_t count = left < d.block_size ? left : d.block_size;
        const int heads = a.heads.count;  // h below counts from the span's first head
        const int64_t per_token = static_cast<int64_t>(heads) * d.head_dim;
        const int64_t elements = count * per_token;
        float scale = 1.0f;
        if (d.dtype == DType::Float8) {
            float amax = 0.0f;
            for (int64_t e = threadIdx.x; e < elements; e += blockDim.x) {
                const int64_t t = first + e / per_token;
                amax = fmaxf(amax, fabsf(convert_value(a, li, kv, t,
                                                       static_cast<int>((e / d.head_dim) % heads),
                                                       static_cast<int>(e % d.head_dim))));
            }
            partial[threadIdx.x] = amax;
            __syncthreads();
            for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
                if (threadIdx.x < stride) {
                    partial[threadIdx.x] =
                        fmaxf(partial[threadIdx.x], partial[threadIdx.x + stride]);
                }
                __syncthreads();
            }
            scale = fp8_scale(partial[0]);
            if (threadIdx.x == 0) {
                a.scales[(li * a.num_dst_ids + bi) * 2 + kv] = scale;
            }
            __syncthreads();  // partial[0] is read by all before the next job overwrites it
        }
        char* block =
            reinterpret_cast<char*>(block_address(a.dst_planes[2 * li + kv], a.dst_ids[bi]));
        const bool bits = copies_bits(a.src_shape.dtype, d.dtype);
        const int64_t es = dtype_nbytes(d.dtype);
        for (int64_t e = threadIdx.x; e < elements; e += blockDim.x) {
            const int64_t t = first + e / per_token;
            const int h = static_cast<int>((e / d.head_dim) % heads);
            const int x = static_cast<int>(e % d.head_dim);
            const int64_t at =
                element_index(d, 0, static_cast<int>(t - first), a.heads.dst_first + h, x);
            if (bits) {  // as the host path: the element's bytes, unchanged
                const BlockShape& s = a.src_shape;
                const char* src = reinterpret_cast<const char*>(
                    block_address(a.src_planes[2 * li + kv], a.src_ids[t / s.block_size]));
                memcpy(block + es * at,
                       src + es * element_index(s, 0, static_cast<int>(t % s.block_size),
                                                a.heads.src_first + h, x),
                       static_cast<size_t>(es));
            } else {
                store_element(block, d.dtype, at, convert_value(a, li, kv, t, h, x) / scale);
            }
        }
    }
}

void finish_launch(const char* what) {
    KVMOVE_CUDA_CHECK(cudaGetLastError(), "cannot launch " << what);
    KVMOVE_CUDA_CHECK(cudaDeviceSynchronize(), what << " failed on the device");
}

}  // namespace

void pack_blocks_cuda(const CacheView& cache, const std::vector<int64_t>& ids, char* staging,
                      bool unpack) {
    if (ids.empty() || cache.planes.empty()) {
        return;
    }
    DeviceGuard guard(cache.device);
    KVMOVE_CUDA_CHECK(cudaDeviceSynchronize(), "CUDA device " << cache.device << " failed");
    DeviceArray<int64_t> d_ids(ids);
    DeviceArray<Plane> d_planes(cache.planes);
    const uint64_t block_nbytes = cache.planes[0].block_nbytes;
    bool vector = block_nbytes % 16 == 0 && reinterpret_cast<uintptr_t>(staging) % 16 == 0;
    for (const Plane& p : cache.planes) {
        vector = vector && p.base % 16 == 0 && p.block_stride % 16 == 0;
    }
    const auto num_layers = static_cast<int64_t>(cache.planes.size());
    const auto num_ids = static_cast<int64_t>(ids.size());
    pack_kernel<<<grid_for(num_ids * num_layers), kThreads>>>(
        d_planes.get(), num_layers, d_ids.get(), num_ids, block_nbytes, staging, unpack, vector);
    finish_launch(unpack ? "unpack_blocks" : "pack_blocks");
}

void convert_blocks_cuda(const ConvertPlan& plan) {
    DeviceGuard guard(plan.src.device);
    KVMOVE_CUDA_CHECK(cudaDeviceSynchronize(), "CUDA device " << plan.src.device << " failed");
    DeviceArray<int64_t> src_ids(plan.src_ids), dst_ids(plan.dst_ids);
    DeviceArray<Plane> src_planes(plan.src.planes), dst_planes(plan.dst.planes);
    ConvertArgs args{src_planes.get(),
                     dst_planes.get(),
                     plan.src.shape,
                     plan.dst.shape,
                     src_ids.get(),
                     dst_ids.get(),
                     static_cast<int64_t>(plan.src_ids.size()),
                     static_cast<int64_t>(plan.dst_ids.size()),
                     static_cast<int64_t>(plan.src.planes.size() / 2),
                     plan.num_tokens,
                     plan.heads,
                     plan.scales};
    convert_kernel<<<grid_for(args.num_layers * args.num_dst_ids * 2), kThreads>>>(args);
    finish_launch("convert_blocks");
}

}  // namespace kvmove
