#include "memory/region.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "common/errors.h"
#include "cuda/cuda_memory.h"

namespace kvmove {

namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;

}  // namespace

void RegionFree::operator()(char* p) const {
    if (device >= 0) {
        cuda_free(device, p);
        return;
    }
    if (pinned != nullptr) {
        cuda_unpin(pinned);
    }
    munmap(p, mapped_nbytes);
}

void* Region::host_data() const {
    KVMOVE_CHECK(!on_device(), Config,
                 "a region on CUDA device " << device() << " has no host view (" << nbytes_
                                            << " bytes): use __cuda_array_interface__");
    return data();
}

Region::Region(uint64_t nbytes, bool huge_pages, int device, bool pin)
    : nbytes_(nbytes), huge_pages_(huge_pages) {
    KVMOVE_CHECK(nbytes > 0, Config, "region nbytes must be positive, got " << nbytes);
    if (device >= 0) {
        KVMOVE_CHECK(!huge_pages && !pin, Config,
                     "huge_pages and pin apply to host memory, not to CUDA device " << device);
        mapping_ = std::unique_ptr<char, RegionFree>(static_cast<char*>(cuda_alloc(device, nbytes)),
                                                     RegionFree{0, device, nullptr});
        return;
    }
    // Over-map by one huge page so the data can start on a 2 MiB boundary.
    size_t mapped = huge_pages ? nbytes + kHugePageBytes : nbytes;
    KVMOVE_CHECK(mapped >= nbytes, Config, "region nbytes " << nbytes << " overflows");
    // MAP_POPULATE faults every page in now: a KV cache is written by transfers from other
    // processes, and first-touch faults there cost 5x on the first transfer (measured: a
    // 524 MB write took 2.6 s into fresh pages, 0.55 s into touched ones).
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    KVMOVE_CHECK(p != MAP_FAILED, Allocation,
                 "cannot map " << nbytes << " bytes for a region: " << std::strerror(errno));
    mapping_ = std::unique_ptr<char, RegionFree>(static_cast<char*>(p), RegionFree{mapped});
    if (huge_pages) {
        auto start = reinterpret_cast<uintptr_t>(p);
        offset_ = ((start + kHugePageBytes - 1) & ~(kHugePageBytes - 1)) - start;
        // Advisory: a kernel without transparent huge pages keeps 4 KiB pages, which still work.
        madvise(data(), nbytes, MADV_HUGEPAGE);
    }
    if (pin && cuda_pin(data(), nbytes)) {
        mapping_.get_deleter().pinned = data();
    }
}

}  // namespace kvmove
