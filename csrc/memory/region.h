// Region: one span of host or device memory with a single owner.
//
// The bytes behind a KVCache. On the host they are a memfd (an anonymous file) mapped shared,
// page aligned, zero-filled, populated up front (see region.cpp): another process of this user
// on this host can map the same pages (transport/peer_mapping.h), which is how same-host peers
// copy straight into each other's blocks. The file is sealed against shrinking and growing,
// so a process that maps it never faults past its end (SIGBUS), whatever its owner does; and
// it has no name, so nothing is left behind when the owner dies, even by SIGKILL (a named
// /dev/shm object would be). huge_pages=true aligns to 2 MiB and asks for
// transparent huge pages (madvise), which cuts TLB misses when a transfer sweeps gigabytes;
// pin=true page-locks it for DMA (cudaHostRegister) where a CUDA device is present. On a device
// (device >= 0) it is one cudaMalloc, zero-filled, 256-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kvmove {

// Frees what a Region holds: unpins and unmaps host memory, or frees device memory.
struct RegionFree {
    size_t mapped_nbytes = 0;
    int device = -1;         // >= 0: the pointer is cudaMalloc'ed on this device
    int memfd = -1;          // host memory: its file, closed with the mapping
    void* pinned = nullptr;  // host memory page-locked at this address
    void operator()(char* p) const;
};

class Region {
public:
    explicit Region(uint64_t nbytes, bool huge_pages = false, int device = -1, bool pin = false);
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;

    void* data() const { return mapping_.get() + offset_; }
    // data() for code that reads it on the CPU (the buffer protocol); ConfigError on a device.
    void* host_data() const;
    uint64_t addr() const { return reinterpret_cast<uint64_t>(data()); }
    uint64_t nbytes() const { return nbytes_; }
    bool huge_pages() const { return huge_pages_; }
    int device() const { return mapping_.get_deleter().device; }  // -1: host memory
    bool on_device() const { return device() >= 0; }
    bool pinned() const { return mapping_.get_deleter().pinned != nullptr; }
    // The memfd whose offset 0 is data() (host memory), or -1 (on a device).
    int memfd() const { return mapping_.get_deleter().memfd; }

private:
    std::unique_ptr<char, RegionFree> mapping_;
    size_t offset_ = 0;  // from the mapping's start to the aligned data
    uint64_t nbytes_;
    bool huge_pages_;
};

}  // namespace kvmove
