#include "memory/block_pool.h"

#include <algorithm>
#include <climits>

#include "common/errors.h"

namespace kvmove {

namespace {

int64_t checked_num_blocks(int64_t num_blocks) {
    KVMOVE_CHECK(num_blocks > 0 && num_blocks <= INT32_MAX, Config,
                 "num_blocks must be in [1, " << INT32_MAX << "], got " << num_blocks);
    return num_blocks;
}

}  // namespace

BlockPool::BlockPool(int64_t num_blocks)
    : num_blocks_(checked_num_blocks(num_blocks)), free_runs_(num_blocks_) {
    ref_count_.assign(num_blocks_, 0);
    hash_.assign(num_blocks_, 0);
    has_hash_.assign(num_blocks_, false);
    lru_prev_.assign(num_blocks_ + 1, num_blocks_);
    lru_next_.assign(num_blocks_ + 1, num_blocks_);
}

int64_t BlockPool::num_free() const {
    std::lock_guard<std::mutex> lock(mu_);
    return free_runs_.num_free() + num_cached_;
}

int64_t BlockPool::num_used() const {
    std::lock_guard<std::mutex> lock(mu_);
    return num_blocks_ - free_runs_.num_free() - num_cached_;
}

int64_t BlockPool::num_cached() const {
    std::lock_guard<std::mutex> lock(mu_);
    return num_cached_;
}

std::optional<std::vector<BlockId>> BlockPool::allocate(int64_t n) {
    KVMOVE_CHECK(n >= 1, Config,
                 "cannot allocate " << n << " blocks: n must be in [1, " << num_blocks_ << "]");
    KVMOVE_CHECK(n <= num_blocks_, Config,
                 "cannot allocate " << n << " blocks: the pool has " << num_blocks_);
    std::lock_guard<std::mutex> lock(mu_);
    if (n > free_runs_.num_free() + num_cached_) {
        return std::nullopt;
    }
    while (free_runs_.num_free() < n) {
        evict_lru();
    }
    std::vector<BlockId> out;
    out.reserve(n);
    free_runs_.take(n, out);
    for (BlockId id : out) {
        ref_count_[id] = 1;
    }
    return out;
}

void BlockPool::free(const std::vector<BlockId>& ids) {
    std::lock_guard<std::mutex> lock(mu_);
    // Released blocks enter the LRU list last-to-first, so the tail of a sequence is evicted
    // before its head and a cached prefix stays usable as long as possible (as vLLM does).
    std::vector<BlockId> released;
    for (size_t i = ids.size(); i-- > 0;) {
        BlockId id = ids[i];
        if (id < 0 || id >= num_blocks_ || ref_count_[id] == 0) {
            undo_free(ids, i + 1);
            reject_free(ids, id);
        }
        if (--ref_count_[id] == 0) {
            released.push_back(id);
        }
    }
    std::vector<BlockId> uncached;
    for (BlockId id : released) {
        if (has_hash_[id]) {
            lru_push_back(id);
        } else {
            uncached.push_back(id);
        }
    }
    // Usually the ids were one ascending run, now reversed: make runs() see them ascending.
    std::reverse(uncached.begin(), uncached.end());
    if (!std::is_sorted(uncached.begin(), uncached.end())) {
        std::sort(uncached.begin(), uncached.end());
    }
    for (auto [start, num] : runs(uncached)) {
        free_runs_.insert(start, num);
    }
}

// Restores the references free() dropped for ids[from..] before it met a bad id.
void BlockPool::undo_free(const std::vector<BlockId>& ids, size_t from) {
    for (size_t i = from; i < ids.size(); ++i) {
        ++ref_count_[ids[i]];
    }
}

void BlockPool::reject_free(const std::vector<BlockId>& ids, BlockId id) const {
    check_id(id, "free");
    auto count = std::count(ids.begin(), ids.end(), id);
    KVMOVE_CHECK(ref_count_[id] > 0, Block, "cannot free block " << id << ": it is free");
    KVMOVE_FAIL(Block, "cannot free block " << id << " " << count
                                            << " times: its reference count is " << ref_count_[id]);
}

void BlockPool::share(const std::vector<BlockId>& ids) {
    std::lock_guard<std::mutex> lock(mu_);
    for (BlockId id : ids) {
        check_id(id, "share");
        KVMOVE_CHECK(ref_count_[id] > 0, Block,
                     "cannot share block "
                         << id << ": it is not allocated"
                         << (has_hash_[id] ? " (match() revives cached blocks)" : ""));
    }
    for (BlockId id : ids) {
        ++ref_count_[id];
    }
}

void BlockPool::commit(const std::vector<BlockId>& ids, const std::vector<BlockHash>& hashes) {
    KVMOVE_CHECK(ids.size() == hashes.size(), Config,
                 "cannot commit " << ids.size() << " blocks with " << hashes.size()
                                  << " hashes: the lengths must match");
    std::lock_guard<std::mutex> lock(mu_);
    std::unordered_map<BlockId, BlockHash> seen;
    for (size_t i = 0; i < ids.size(); ++i) {
        BlockId id = ids[i];
        check_id(id, "commit");
        KVMOVE_CHECK(ref_count_[id] > 0, Block,
                     "cannot commit block " << id << ": it is not allocated");
        // A block keeps its hash for life (until evicted); one call may not give it two.
        auto first = seen.emplace(id, hashes[i]).first;
        BlockHash expected = has_hash_[id] ? hash_[id] : first->second;
        KVMOVE_CHECK(hashes[i] == expected, Block,
                     "cannot commit block " << id << " with hash " << hashes[i]
                                            << ": it already has hash " << expected);
    }
    for (size_t i = 0; i < ids.size(); ++i) {
        // A hash already cached by another block keeps that block; this one stays untagged
        // and returns to the free runs when freed (the two hold identical content).
        if (!has_hash_[ids[i]] && cached_by_hash_.emplace(hashes[i], ids[i]).second) {
            hash_[ids[i]] = hashes[i];
            has_hash_[ids[i]] = true;
        }
    }
}

std::vector<BlockId> BlockPool::match(const std::vector<BlockHash>& hashes) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<BlockId> out;
    for (BlockHash h : hashes) {
        auto it = cached_by_hash_.find(h);
        if (it == cached_by_hash_.end()) {
            break;
        }
        BlockId id = it->second;
        if (ref_count_[id] == 0) {
            lru_unlink(id);
        }
        ++ref_count_[id];
        out.push_back(id);
    }
    return out;
}

int32_t BlockPool::ref_count(BlockId id) const {
    std::lock_guard<std::mutex> lock(mu_);
    check_id(id, "query");
    return ref_count_[id];
}

std::optional<BlockHash> BlockPool::block_hash(BlockId id) const {
    std::lock_guard<std::mutex> lock(mu_);
    check_id(id, "query");
    return has_hash_[id] ? std::optional<BlockHash>(hash_[id]) : std::nullopt;
}

void BlockPool::check_id(BlockId id, const char* action) const {
    KVMOVE_CHECK(
        id >= 0 && id < num_blocks_, Block,
        "cannot " << action << " block " << id << ": ids are in [0, " << num_blocks_ << ")");
}

void BlockPool::evict_lru() {
    BlockId id = lru_next_[num_blocks_];
    lru_unlink(id);
    cached_by_hash_.erase(hash_[id]);
    has_hash_[id] = false;
    free_runs_.insert(id, 1);
}

void BlockPool::lru_push_back(BlockId id) {
    BlockId tail = lru_prev_[num_blocks_];
    lru_prev_[id] = tail;
    lru_next_[id] = num_blocks_;
    lru_next_[tail] = id;
    lru_prev_[num_blocks_] = id;
    ++num_cached_;
}

void BlockPool::lru_unlink(BlockId id) {
    lru_next_[lru_prev_[id]] = lru_next_[id];
    lru_prev_[lru_next_[id]] = lru_prev_[id];
    --num_cached_;
}

}  // namespace kvmove
