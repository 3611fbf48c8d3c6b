// BlockFile: KV blocks in fixed-size slots of one file, each written with its checksum.
//
// The bytes of a disk storage tier. A slot holds one block across every layer, contiguous,
// padded to a multiple of 4 KiB so the file can be opened with O_DIRECT:
//
//   file:  | slot 0                              | slot 1      | ...
//   slot:  | layer 0 | layer 1 | ... | layer L-1 | zero pad to kSlotAlign |
//
//   offset(slot) = slot * slot_nbytes
//
// A KVCache keeps a block's layers apart (layer-major, see kv_cache.h), so writes gather each
// block's L slices into a page-aligned staging buffer and reads scatter them back. Runs of
// consecutive slots move in large requests whatever the blocks' ids in the cache: a write as
// one pwrite of up to kStagingNbytes, a read as preads of up to kReadPartNbytes, many in
// flight (see read()). One staging area serves both:
//
//   staging:  | write buffer 0            | write buffer 1            |   (2 x kStagingNbytes)
//             | part 0 | part 1 | part 2 | ...              | part R-1 |   (R read buffers)
//
// Integrity: write() returns XXH3(slot data, seed = the block's content hash) per block;
// read() recomputes it and scatters only blocks that match. Seeding with the content hash
// makes a slot that holds another block's (intact) data fail too. A torn, truncated or
// overwritten slot is reported, never copied into the cache.
//
// Which slot holds which block is the caller's index (kvmove/store/index.py); this class only
// moves bytes. Calls are serialized by an internal mutex (they share the staging buffers) and
// are meant to run with the GIL released.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "memory/kv_cache.h"
#include "storage/io_threads.h"

namespace kvmove {

struct ScatterTarget;  // block_file.cpp

struct StagingFree {
    void operator()(char* p) const;
};

class BlockFile {
public:
    static constexpr uint64_t kSlotAlign = 4096;
    static constexpr uint64_t kStagingNbytes = 16ULL << 20;  // per write buffer
    static constexpr uint64_t kReadPartNbytes = 2ULL << 20;  // whole slots per read request
    static constexpr uint64_t kMaxReadParts = 16;            // read buffers
    static constexpr int kIoThreads = 8;                     // requests in flight, at most
    // The longest wait for one request. Past it the disk is hung: the file refuses further
    // calls (a request still running may yet write into the staging buffers).
    static constexpr std::chrono::seconds kIoTimeout{120};

    // Opens (creating if needed) path and sizes it to num_slots slots of block_nbytes data.
    // direct: O_DIRECT, bypassing the page cache (falls back to buffered I/O where the file
    // system refuses it; direct() says which).
    BlockFile(const std::string& path, uint64_t block_nbytes, int64_t num_slots, bool direct);
    ~BlockFile();
    BlockFile(const BlockFile&) = delete;
    BlockFile& operator=(const BlockFile&) = delete;

    const std::string& path() const { return path_; }
    uint64_t block_nbytes() const { return block_nbytes_; }
    uint64_t slot_nbytes() const { return slot_nbytes_; }
    int64_t num_slots() const { return num_slots_; }
    bool direct() const { return direct_; }

    // Writes block ids[i] of cache (every layer) into slots[i]; returns each block's checksum.
    // Throws StoreError on an I/O error (a full disk included): the slots' contents are then
    // undefined, and the caller must not record them.
    std::vector<uint64_t> write(const KVCache& cache, const std::vector<BlockId>& ids,
                                const std::vector<int64_t>& slots,
                                const std::vector<uint64_t>& hashes);
    // Reads slots[i] into block ids[i] of cache while their checksums match; ok[i] says
    // whether block i arrived, and only a prefix arrives: the first block that fails and every
    // block after it are 0. The block that fails is left untouched in the cache; blocks after
    // it may have received their own intact bytes (several are read and copied at once) but
    // do not count. An unreadable slot (I/O error, past the end of the file) fails like a bad
    // checksum.
    std::vector<uint8_t> read(KVCache& cache, const std::vector<BlockId>& ids,
                              const std::vector<int64_t>& slots,
                              const std::vector<uint64_t>& hashes,
                              const std::vector<uint64_t>& checksums);
    // Flushes written data to the device (fdatasync).
    void sync();
    // Closes the file now (the destructor would otherwise, whenever Python collects this);
    // later calls raise StoreError.
    void close();

private:
    void check_args(const KVCache& cache, const std::vector<BlockId>& ids,
                    const std::vector<int64_t>& slots, size_t num_hashes) const;
    // Consecutive-slot groups [begin, end) of indexes into slots, each of at most max_nbytes
    // (and at least one slot).
    std::vector<std::pair<size_t, size_t>> chunks(const std::vector<int64_t>& slots,
                                                  uint64_t max_nbytes) const;
    // One read() call: its arguments, its parts (consecutive-slot groups, one request each)
    // and where the I/O threads copy intact blocks (null: read() copies them itself).
    struct ReadRequest {
        const std::vector<BlockId>& ids;
        const std::vector<int64_t>& slots;
        const std::vector<uint64_t>& hashes;
        const std::vector<uint64_t>& checksums;
        std::vector<std::pair<size_t, size_t>> parts;
        std::shared_ptr<ScatterTarget> target;
    };
    // Queues the read of part k into read buffer k % num_read_parts_; the future says how
    // many of its slots are intact (read whole, checksum matching), leading ones first.
    std::future<size_t> start_read(size_t k, const ReadRequest& request);
    char* read_buffer(size_t k) const;
    // Copies slots [begin, end) of a read buffer into blocks ids[begin, end) of cache.
    void scatter_part(KVCache& cache, const char* in, const std::vector<BlockId>& ids, size_t begin,
                      size_t end);
    // Stops the request's copies and waits for its reads still in flight (bounded).
    void finish_read(const ReadRequest& request,
                     std::deque<std::future<size_t>>& in_flight) noexcept;
    // Waits for reads still in flight (bounded; past kIoTimeout marks the file hung).
    void drain(std::deque<std::future<size_t>>& in_flight) noexcept;
    // future.get(), waiting at most kIoTimeout; past it marks the file hung and throws.
    template <class T>
    T wait_io(std::future<T>& future, const char* what, uint64_t offset);

    const std::string path_;
    const uint64_t block_nbytes_;
    const uint64_t slot_nbytes_;
    const int64_t num_slots_;
    int fd_ = -1;
    bool direct_ = false;
    bool hung_ = false;  // a request ran past kIoTimeout: every later call fails
    std::mutex mu_;
    std::unique_ptr<char, StagingFree> staging_;  // declared before io_: outlives its tasks
    uint64_t write_nbytes_ = 0;                   // each of the two write buffers
    uint64_t read_part_nbytes_ = 0;               // each of the num_read_parts_ read buffers
    uint64_t num_read_parts_ = 0;
    IoThreads io_{kIoThreads};
};

}  // namespace kvmove
