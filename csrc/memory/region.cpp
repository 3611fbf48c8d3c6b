#include "memory/region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/errors.h"
#include "cuda/cuda_memory.h"

namespace kvmove {

namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;

// An anonymous file of nbytes, sealed at that size. Close-on-exec: a program the process
// starts does not inherit it; a peer that wants it opens /proc/<pid>/fd/<fd> instead.
int sealed_memfd(uint64_t nbytes) {
    int fd = memfd_create("kvmove-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    KVMOVE_CHECK(
        fd >= 0, Allocation,
        "cannot create a memfd for a region of " << nbytes << " bytes: " << std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(nbytes)) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        const int error = errno;
        close(fd);
        KVMOVE_FAIL(Allocation, "cannot size and seal a memfd of "
                                    << nbytes << " bytes for a "
                                    << "region: " << std::strerror(error));
    }
    return fd;
}

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
    if (memfd >= 0) {
        close(memfd);
    }
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
                                                     RegionFree{0, device, -1, nullptr});
        return;
    }
    // Over-map by one huge page so the data can start on a 2 MiB boundary: an inaccessible
    // reservation first, then the file over its aligned part.
    size_t mapped = huge_pages ? nbytes + kHugePageBytes : nbytes;
    KVMOVE_CHECK(mapped >= nbytes, Config, "region nbytes " << nbytes << " overflows");
    const int fd = sealed_memfd(nbytes);
    void* p =
        huge_pages ? mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) : nullptr;
    if (huge_pages && p != MAP_FAILED) {
        auto start = reinterpret_cast<uintptr_t>(p);
        offset_ = ((start + kHugePageBytes - 1) & ~(kHugePageBytes - 1)) - start;
    }
    // MAP_POPULATE faults every page in now: a KV cache is written by transfers from other
    // processes, and first-touch faults there cost 5x on the first transfer (measured: a
    // 524 MB write took 2.6 s into fresh pages, 0.55 s into touched ones).
    void* view = p == MAP_FAILED
                     ? MAP_FAILED
                     : mmap(static_cast<char*>(p) + offset_, nbytes, PROT_READ | PROT_WRITE,
                            MAP_SHARED | MAP_POPULATE | (huge_pages ? MAP_FIXED : 0), fd, 0);
    if (view == MAP_FAILED) {
        const int error = errno;
        if (huge_pages && p != MAP_FAILED) {
            munmap(p, mapped);
        }
        close(fd);
        KVMOVE_FAIL(Allocation,
                    "cannot map " << nbytes << " bytes for a region: " << std::strerror(error));
    }
    p = huge_pages ? p : view;
    mapping_ = std::unique_ptr<char, RegionFree>(static_cast<char*>(p),
                                                 RegionFree{mapped, -1, fd, nullptr});
    if (huge_pages) {
        // Advisory: a kernel without transparent huge pages for shared memory (shmem_enabled
        // "never") keeps 4 KiB pages, which still work.
        madvise(data(), nbytes, MADV_HUGEPAGE);
    }
    if (pin && cuda_pin(data(), nbytes)) {
        mapping_.get_deleter().pinned = data();
    }
}

}  // namespace kvmove
