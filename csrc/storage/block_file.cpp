#include "storage/block_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <shared_mutex>

#include "common/errors.h"
#include "common/hash.h"

namespace kvmove {

void StagingFree::operator()(char* p) const {
    std::free(p);
}

namespace {

uint64_t round_up(uint64_t n, uint64_t align) {
    return (n + align - 1) / align * align;
}

// Writes all of [data, data + nbytes) at offset; 0, or the errno of the failure.
int pwrite_all(int fd, const char* data, uint64_t nbytes, uint64_t offset) {
    while (nbytes > 0) {
        ssize_t n = ::pwrite(fd, data, nbytes, static_cast<off_t>(offset));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return n == 0 ? ENOSPC : errno;
        }
        data += n;
        nbytes -= static_cast<uint64_t>(n);
        offset += static_cast<uint64_t>(n);
    }
    return 0;
}

// Reads up to nbytes at offset; the count read (short at end of file), or -1 with errno set.
int64_t pread_all(int fd, char* data, uint64_t nbytes, uint64_t offset) {
    uint64_t done = 0;
    while (done < nbytes) {
        ssize_t n = ::pread(fd, data + done, nbytes - done, static_cast<off_t>(offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            return -1;
        }
        if (n == 0) {
            break;
        }
        done += static_cast<uint64_t>(n);
    }
    return static_cast<int64_t>(done);
}

// The staging area in transparent huge pages where the kernel grants them. An O_DIRECT request
// takes one segment per physically contiguous piece of its buffer, and a disk takes at most
// max_segments of them per request (254 on the development VM's virtio disk): in 4 KiB pages
// a request stops at 1 MiB, in 2 MiB pages at max_sectors_kb (4 MiB there). Measured there,
// 500 MB O_DIRECT, 4 reads of 4 MiB in flight: 0.29-0.30 GB/s into 4 KiB pages, 1.6-1.9 into
// huge pages; a buffered cold read of the same file 0.4-1.1. madvise may refuse (THP off):
// the buffer then works in small pages, only slower.
std::unique_ptr<char, StagingFree> allocate_staging(uint64_t nbytes) {
    constexpr uint64_t kHugePage = 2ULL << 20;
    nbytes = round_up(nbytes, kHugePage);
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, nbytes) != 0) {
        return nullptr;
    }
    ::madvise(p, nbytes, MADV_HUGEPAGE);
    return std::unique_ptr<char, StagingFree>(static_cast<char*>(p));
}

}  // namespace

BlockFile::BlockFile(const std::string& path, uint64_t block_nbytes, int64_t num_slots, bool direct)
    : path_(path),
      block_nbytes_(block_nbytes),
      slot_nbytes_(round_up(block_nbytes, kSlotAlign)),
      num_slots_(num_slots) {
    KVMOVE_CHECK(block_nbytes > 0, Config, "block_nbytes must be positive, got " << block_nbytes);
    KVMOVE_CHECK(num_slots > 0, Config, "a block file needs at least one slot, got " << num_slots);
    // 0600: stored KV gives its prompts away. kvmove/store/private.py creates the file (or
    // tightens an old one) before this opens it; the mode here covers any other caller.
    int flags = O_RDWR | O_CREAT | O_CLOEXEC;
    fd_ = direct ? ::open(path.c_str(), flags | O_DIRECT, 0600) : -1;
    direct_ = fd_ >= 0;
    if (fd_ < 0) {  // not asked for, or the file system refuses O_DIRECT (tmpfs: EINVAL)
        fd_ = ::open(path.c_str(), flags, 0600);
    }
    KVMOVE_CHECK(fd_ >= 0, Store,
                 "cannot open block file " << path << ": " << std::strerror(errno));
    const uint64_t file_nbytes = slot_nbytes_ * static_cast<uint64_t>(num_slots);
    if (::ftruncate(fd_, static_cast<off_t>(file_nbytes)) != 0) {
        int err = errno;
        ::close(fd_);
        KVMOVE_FAIL(Store, "cannot size block file " << path << " to " << file_nbytes
                                                     << " bytes: " << std::strerror(err));
    }
    write_nbytes_ = std::max(slot_nbytes_, kStagingNbytes / slot_nbytes_ * slot_nbytes_);
    read_part_nbytes_ = std::max(slot_nbytes_, kReadPartNbytes / slot_nbytes_ * slot_nbytes_);
    num_read_parts_ = std::min(kMaxReadParts, 2 * write_nbytes_ / read_part_nbytes_);  // >= 2
    staging_ = allocate_staging(2 * write_nbytes_);
    if (!staging_) {
        ::close(fd_);
        KVMOVE_FAIL(Allocation, "cannot allocate a " << 2 * write_nbytes_ << " B staging buffer");
    }
}

BlockFile::~BlockFile() {
    close();
}

void BlockFile::close() {
    std::lock_guard<std::mutex> lock(mu_);
    if (fd_ >= 0) {
        ::close(fd_);
        fd_ = -1;
    }
}

void BlockFile::check_args(const KVCache& cache, const std::vector<BlockId>& ids,
                           const std::vector<int64_t>& slots, size_t num_hashes) const {
    KVMOVE_CHECK(fd_ >= 0, Store, "block file " << path_ << " is closed");
    KVMOVE_CHECK(!hung_, Store,
                 "block file " << path_ << " is unusable: a request to its disk ran past "
                               << kIoTimeout.count() << " s");
    const uint64_t cache_block_nbytes = cache.block_nbytes() * cache.num_layers();
    KVMOVE_CHECK(cache_block_nbytes == block_nbytes_, Config,
                 "the cache's blocks are " << cache_block_nbytes << " B, this block file's are "
                                           << block_nbytes_ << " B");
    KVMOVE_CHECK(ids.size() == slots.size() && ids.size() == num_hashes, Config,
                 "need one slot and one hash per block id, got "
                     << ids.size() << " ids, " << slots.size() << " slots and " << num_hashes
                     << " hashes");
    for (size_t i = 0; i < ids.size(); ++i) {
        KVMOVE_CHECK(ids[i] >= 0 && ids[i] < cache.num_blocks(), Block,
                     "block id " << ids[i] << " is out of range: ids are in [0, "
                                 << cache.num_blocks() << ")");
        KVMOVE_CHECK(
            slots[i] >= 0 && slots[i] < num_slots_, Config,
            "slot " << slots[i] << " is out of range: slots are in [0, " << num_slots_ << ")");
    }
}

std::vector<std::pair<size_t, size_t>> BlockFile::chunks(const std::vector<int64_t>& slots,
                                                         uint64_t max_nbytes) const {
    const size_t max_slots = std::max<uint64_t>(1, max_nbytes / slot_nbytes_);
    std::vector<std::pair<size_t, size_t>> out;
    for (size_t begin = 0; begin < slots.size();) {
        size_t end = begin + 1;
        while (end < slots.size() && end - begin < max_slots && slots[end] == slots[end - 1] + 1) {
            ++end;
        }
        out.emplace_back(begin, end);
        begin = end;
    }
    return out;
}

namespace {

// Block id of layer <-> its bytes in a slot: the parts one after the other, so a cache with K
// and V apart stores the same slot as one with them together.
void gather_block(const KVGeometry& g, int64_t layer, BlockId id, char* out, bool device) {
    for (int64_t part = 0; part < g.num_parts(); ++part) {
        const Plane& p = g.plane(layer, part);
        copy_bytes(out, reinterpret_cast<const void*>(block_address(p, id)), p.block_nbytes,
                   device);
        out += p.block_nbytes;
    }
}

void scatter_block(const char* in, const KVGeometry& g, int64_t layer, BlockId id, bool device) {
    for (int64_t part = 0; part < g.num_parts(); ++part) {
        const Plane& p = g.plane(layer, part);
        copy_bytes(reinterpret_cast<void*>(block_address(p, id)), in, p.block_nbytes, device);
        in += p.block_nbytes;
    }
}

}  // namespace

template <class T>
T BlockFile::wait_io(std::future<T>& future, const char* what, uint64_t offset) {
    if (future.wait_for(kIoTimeout) == std::future_status::timeout) {
        hung_ = true;
        KVMOVE_FAIL(Store, "a " << what << " at offset " << offset << " of " << path_
                                << " did not return in " << kIoTimeout.count()
                                << " s; the block file is unusable");
    }
    return future.get();
}

// Writes pipeline two staging buffers: while the disk writes one chunk, this thread gathers
// and checksums the next. At one request in flight the disk and the CPU otherwise wait for
// each other. (Writes already beat dd oflag=direct by 1.5-2x; reads needed more, see read().)
std::vector<uint64_t> BlockFile::write(const KVCache& cache, const std::vector<BlockId>& ids,
                                       const std::vector<int64_t>& slots,
                                       const std::vector<uint64_t>& hashes) {
    check_args(cache, ids, slots, hashes.size());
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t layer_nbytes = cache.block_nbytes();
    const bool device = cache.on_device();  // a device cache's blocks stage via host
    if (device) {
        sync_devices(cache, cache);  // what other streams wrote to the blocks is there
    }
    std::vector<uint64_t> checksums(ids.size());
    std::future<int> in_flight;
    uint64_t in_flight_offset = 0;
    auto check_written = [&] {
        int err = in_flight.valid() ? wait_io(in_flight, "write", in_flight_offset) : 0;
        KVMOVE_CHECK(err == 0, Store,
                     "cannot write at offset " << in_flight_offset << " of " << path_ << ": "
                                               << std::strerror(err));
    };
    size_t k = 0;
    for (auto [begin, end] : chunks(slots, write_nbytes_)) {
        char* buffer = staging_.get() + (k++ % 2) * write_nbytes_;
        char* out = buffer;
        for (size_t i = begin; i < end; ++i, out += slot_nbytes_) {
            for (int64_t layer = 0; layer < cache.num_layers(); ++layer) {
                gather_block(cache.geometry(), layer, ids[i], out + layer * layer_nbytes, device);
            }
            std::memset(out + block_nbytes_, 0, slot_nbytes_ - block_nbytes_);
            if (!device) {  // while the block is still in the CPU's caches
                checksums[i] = xxh3(out, block_nbytes_, hashes[i]);
            }
        }
        if (device) {  // once the device's copies into the staging buffer are done
            sync_devices(cache, cache);
            for (size_t i = begin; i < end; ++i) {
                checksums[i] = xxh3(buffer + (i - begin) * slot_nbytes_, block_nbytes_, hashes[i]);
            }
        }
        check_written();  // the chunk before: its buffer is the one we fill next
        const uint64_t nbytes = (end - begin) * slot_nbytes_;
        in_flight_offset = static_cast<uint64_t>(slots[begin]) * slot_nbytes_;
        in_flight = io_.submit([fd = fd_, buffer, nbytes, offset = in_flight_offset] {
            return pwrite_all(fd, buffer, nbytes, offset);
        });
    }
    check_written();
    return checksums;
}

// Where the I/O threads of one read() copy the blocks they found intact: a host cache. read()
// closes it (exclusively locked) before it returns early, so no thread writes into the cache
// once read() gave up on its requests.
struct ScatterTarget {
    const KVGeometry& geometry;
    const int64_t num_layers;
    const uint64_t layer_nbytes;
    std::shared_mutex mu;  // shared while a thread copies, exclusive to close
    bool closed = false;

    explicit ScatterTarget(const KVCache& cache)
        : geometry(cache.geometry()),
          num_layers(cache.num_layers()),
          layer_nbytes(cache.block_nbytes()) {}

    void close() {
        std::unique_lock<std::shared_mutex> lock(mu);
        closed = true;
    }
};

namespace {

// One read request: whole consecutive slots into one read buffer, with what checks them. Held
// by value in its task: a task that outlives read() (after a timeout) touches no caller memory
// but the cache, and that only through an open target.
struct ReadPart {
    int fd;
    char* buffer;
    uint64_t offset;
    uint64_t slot_nbytes;
    uint64_t block_nbytes;
    std::vector<uint64_t> hashes;           // per slot: the seed of its checksum...
    std::vector<uint64_t> checksums;        // ...the checksum written with it...
    std::vector<BlockId> ids;               // ...and the block it goes to
    std::shared_ptr<ScatterTarget> target;  // null: read() copies the blocks itself
};

// Copies the first num_intact slots of the part to their blocks (while the target is open).
void scatter_intact(const ReadPart& part, size_t num_intact) {
    ScatterTarget& target = *part.target;
    std::shared_lock<std::shared_mutex> lock(target.mu);
    if (target.closed) {
        return;
    }
    const char* in = part.buffer;
    for (size_t i = 0; i < num_intact; ++i, in += part.slot_nbytes) {
        for (int64_t layer = 0; layer < target.num_layers; ++layer) {
            scatter_block(in + layer * target.layer_nbytes, target.geometry, layer, part.ids[i],
                          false);
        }
    }
}

// Reads the part and checks its slots; how many leading ones are intact (and, with a target,
// copied to their blocks).
size_t read_part(const ReadPart& part) {
    const uint64_t num_slots = part.hashes.size();
    const int64_t got = pread_all(part.fd, part.buffer, num_slots * part.slot_nbytes, part.offset);
    const char* in = part.buffer;
    size_t intact = 0;  // got -1 (an I/O error): none
    for (; intact < num_slots; ++intact, in += part.slot_nbytes) {
        const auto slot_end = static_cast<int64_t>(intact * part.slot_nbytes + part.block_nbytes);
        if (got < slot_end ||
            xxh3(in, part.block_nbytes, part.hashes[intact]) != part.checksums[intact]) {
            break;  // truncated, torn or overwritten: this block and the rest miss
        }
    }
    if (part.target) {
        scatter_intact(part, intact);
    }
    return intact;
}

bool distinct(std::vector<BlockId> ids) {
    std::sort(ids.begin(), ids.end());
    return std::adjacent_find(ids.begin(), ids.end()) == ids.end();
}

}  // namespace

std::future<size_t> BlockFile::start_read(size_t k, const ReadRequest& request) {
    auto [begin, end] = request.parts[k];
    ReadPart part{fd_,
                  read_buffer(k),
                  static_cast<uint64_t>(request.slots[begin]) * slot_nbytes_,
                  slot_nbytes_,
                  block_nbytes_,
                  {request.hashes.begin() + begin, request.hashes.begin() + end},
                  {request.checksums.begin() + begin, request.checksums.begin() + end},
                  {request.ids.begin() + begin, request.ids.begin() + end},
                  request.target};
    return io_.submit([part = std::move(part)] { return read_part(part); });
}

void BlockFile::drain(std::deque<std::future<size_t>>& in_flight) noexcept {
    for (; !in_flight.empty(); in_flight.pop_front()) {
        if (hung_ || in_flight.front().wait_for(kIoTimeout) == std::future_status::timeout) {
            hung_ = true;  // check_args refuses every later call: the buffers may still change
        }
    }
}

// Reads keep up to kIoThreads preads of kReadPartNbytes in flight, each into its own read
// buffer; the I/O thread that read a part checksums it and, for a host cache, copies its
// intact blocks out, so two cores share that work. This thread collects the parts in order and
// starts the next read into each buffer that is free again. We moved from two 16 MiB chunks
// (four preads each) to this because that pipeline drained the disk's queue at every chunk and
// checksummed and scattered on one thread: it read 2.10 GB/s where a buffered cold read of the
// same file (the kernel's readahead) read 2.38-2.54. Measured before and after: docs/store.md.
//
// A device cache (the copies go through CUDA on this thread's device) or a request naming a
// block twice (the copies must land in order) is copied here, in order, instead.
std::vector<uint8_t> BlockFile::read(KVCache& cache, const std::vector<BlockId>& ids,
                                     const std::vector<int64_t>& slots,
                                     const std::vector<uint64_t>& hashes,
                                     const std::vector<uint64_t>& checksums) {
    check_args(cache, ids, slots, hashes.size());
    KVMOVE_CHECK(
        checksums.size() == ids.size(), Config,
        "need one checksum per block id, got " << checksums.size() << " for " << ids.size());
    std::lock_guard<std::mutex> lock(mu_);
    const bool device = cache.on_device();
    if (device) {
        sync_devices(cache, cache);  // nothing still pending on the blocks we overwrite
    }
    const ReadRequest request{
        ids,
        slots,
        hashes,
        checksums,
        chunks(slots, read_part_nbytes_),
        device || !distinct(ids) ? nullptr : std::make_shared<ScatterTarget>(cache)};
    std::deque<std::future<size_t>> in_flight;  // parts [k, k + in_flight.size())
    std::vector<uint8_t> ok(ids.size(), 0);
    try {
        for (size_t k = 0; k < std::min<size_t>(request.parts.size(), num_read_parts_); ++k) {
            in_flight.push_back(start_read(k, request));
        }
        for (size_t k = 0; k < request.parts.size(); ++k) {
            auto [begin, end] = request.parts[k];
            const size_t intact = wait_io(in_flight.front(), "read",
                                          static_cast<uint64_t>(slots[begin]) * slot_nbytes_);
            in_flight.pop_front();
            if (!request.target) {
                scatter_part(cache, read_buffer(k), ids, begin, begin + intact);
            }
            std::fill(ok.begin() + begin, ok.begin() + begin + intact, 1);
            if (begin + intact < end) {
                break;  // a miss: the blocks after it do not count
            }
            if (k + num_read_parts_ < request.parts.size()) {
                in_flight.push_back(start_read(k + num_read_parts_, request));
            }
        }
    } catch (...) {
        finish_read(request, in_flight);
        throw;
    }
    finish_read(request, in_flight);
    return ok;
}

void BlockFile::finish_read(const ReadRequest& request,
                            std::deque<std::future<size_t>>& in_flight) noexcept {
    if (request.target) {
        request.target->close();  // after a miss, later parts copy nothing more
    }
    drain(in_flight);  // the next call reuses their buffers
}

char* BlockFile::read_buffer(size_t k) const {
    return staging_.get() + k % num_read_parts_ * read_part_nbytes_;
}

void BlockFile::scatter_part(KVCache& cache, const char* in, const std::vector<BlockId>& ids,
                             size_t begin, size_t end) {
    const uint64_t layer_nbytes = cache.block_nbytes();
    const bool device = cache.on_device();
    for (size_t i = begin; i < end; ++i, in += slot_nbytes_) {
        for (int64_t layer = 0; layer < cache.num_layers(); ++layer) {
            scatter_block(in + layer * layer_nbytes, cache.geometry(), layer, ids[i], device);
        }
    }
    if (device) {
        sync_devices(cache, cache);  // copied out of this buffer before it is reused
    }
}

void BlockFile::sync() {
    std::lock_guard<std::mutex> lock(mu_);
    KVMOVE_CHECK(fd_ >= 0, Store, "block file " << path_ << " is closed");
    KVMOVE_CHECK(::fdatasync(fd_) == 0, Store,
                 "cannot sync " << path_ << ": " << std::strerror(errno));
}

}  // namespace kvmove
