// Region: one page-aligned span of host memory with a single owner.
//
// The bytes behind a KVCache. Anonymous mmap gives page alignment and zero-filled pages,
// populated up front (see region.cpp); huge_pages=true aligns to 2 MiB and asks for transparent huge
// pages (madvise), which cuts TLB misses when a transfer sweeps gigabytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kvmove {

struct RegionUnmap {
    size_t mapped_nbytes = 0;
    void operator()(char* p) const;
};

class Region {
public:
    explicit Region(uint64_t nbytes, bool huge_pages = false);
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;

    void* data() const { return mapping_.get() + offset_; }
    uint64_t addr() const { return reinterpret_cast<uint64_t>(data()); }
    uint64_t nbytes() const { return nbytes_; }
    bool huge_pages() const { return huge_pages_; }

private:
    std::unique_ptr<char, RegionUnmap> mapping_;
    size_t offset_ = 0;  // from the mapping's start to the aligned data
    uint64_t nbytes_;
    bool huge_pages_;
};

}  // namespace kvmove
