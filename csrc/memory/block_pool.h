// BlockPool: block ids, their reference counts, and the prefix cache over them.
//
// A pool of num_blocks equal blocks with ids 0..num_blocks-1. It owns no memory (see Region and
// KVCache); it decides which ids a request gets and when an id may be reused.
//
// Every block is in exactly one state:
//   free     ref_count == 0, no hash   -> in a free run, handed out by allocate()
//   cached   ref_count == 0, hash set  -> in the LRU list, revived by match(), evicted by
//                                         allocate() when free runs are not enough
//   used     ref_count  > 0            -> owned by one or more requests
//
// Contiguity: free blocks are kept as maximal runs of consecutive ids (FreeRuns). allocate(n)
// takes the shortest run that holds n (best fit), else the longest runs whole until the rest
// fits one.
// Transfers coalesce blocks adjacent on both sides into one operation, so fewer runs mean
// fewer posted operations.
//
// Thread safety: every public method takes the pool's mutex, so one pool may be used from
// several threads (the Python bindings release the GIL around each call).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/kv_geometry.h"
#include "memory/free_runs.h"

namespace kvmove {

class BlockPool {
public:
    explicit BlockPool(int64_t num_blocks);
    BlockPool(const BlockPool&) = delete;
    BlockPool& operator=(const BlockPool&) = delete;

    int64_t num_blocks() const { return num_blocks_; }
    // Free plus cached blocks: what allocate() can hand out right now.
    int64_t num_free() const;
    int64_t num_used() const;
    int64_t num_cached() const;

    // n blocks with reference count 1, or nullopt when fewer than n are free right now
    // (back-pressure). All-or-nothing. Evicts least recently used cached blocks if needed.
    std::optional<std::vector<BlockId>> allocate(int64_t n);
    // Drops one reference per occurrence of each id; a block is released at zero.
    void free(const std::vector<BlockId>& ids);
    // Adds one reference per occurrence of each id (prefix sharing between requests).
    void share(const std::vector<BlockId>& ids);
    // Tags used blocks with their content hash so that, once freed, they stay cached.
    void commit(const std::vector<BlockId>& ids, const std::vector<BlockHash>& hashes);
    // Ids of the longest cached prefix of hashes, each with one new reference.
    std::vector<BlockId> match(const std::vector<BlockHash>& hashes);

    int32_t ref_count(BlockId id) const;
    std::optional<BlockHash> block_hash(BlockId id) const;

private:
    void check_id(BlockId id, const char* action) const;
    void undo_free(const std::vector<BlockId>& ids, size_t from);
    [[noreturn]] void reject_free(const std::vector<BlockId>& ids, BlockId id) const;
    void evict_lru();
    void lru_push_back(BlockId id);
    void lru_unlink(BlockId id);

    const int64_t num_blocks_;
    mutable std::mutex mu_;
    std::vector<int32_t> ref_count_;
    std::vector<BlockHash> hash_;
    std::vector<bool> has_hash_;
    std::unordered_map<BlockHash, BlockId> cached_by_hash_;
    // Intrusive LRU list of cached blocks; index num_blocks_ is the sentinel.
    std::vector<BlockId> lru_prev_;
    std::vector<BlockId> lru_next_;
    int64_t num_cached_ = 0;
    FreeRuns free_runs_;
};

}  // namespace kvmove
