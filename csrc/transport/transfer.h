// Transfer: one batch of block copies to or from a peer, its state, stats and completion.
//
// The Agent posts a transfer's operations in one go and then one flush; the transfer is DONE
// when the flush (and the notification, if any) completes, FAILED when either reports an
// error. wait() blocks without the GIL and always has a deadline.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "memory/block_pool.h"
#include "common/errors.h"

namespace kvmove {

enum class TransferState { Pending, Done, Failed };

struct TransferStats {
    uint64_t nbytes = 0;
    uint64_t num_ops = 0;          // RMA operations posted after coalescing
    double post_seconds = 0;      // time spent posting them
    double complete_seconds = 0;  // from the first post to completion (0 while pending)
};

// One contiguous copy between this process's memory and a peer's.
struct RmaOp {
    uint64_t local_addr;
    uint64_t remote_addr;
    uint64_t nbytes;
};

// The geometry of one side: where its region starts and how blocks are laid out in it.
struct CacheGeometry {
    uint64_t base_addr;
    int64_t num_layers;
    int64_t num_blocks;
    uint64_t block_nbytes;
};

// Coalesced operations copying local_ids[i] <-> remote_ids[i] for each layer: pairs
// consecutive on both sides form one run, each run of each layer is one op, and ops that
// continue the previous one on both sides merge. Inputs must be validated.
std::vector<RmaOp> plan_ops(const std::vector<BlockId>& local_ids,
                            const std::vector<BlockId>& remote_ids,
                            const std::vector<int64_t>& layers, const CacheGeometry& local,
                            const CacheGeometry& remote);

class Transfer {
public:
    Transfer(std::string peer, uint64_t nbytes, uint64_t num_ops);
    Transfer(const Transfer&) = delete;
    Transfer& operator=(const Transfer&) = delete;

    const std::string& peer() const { return peer_; }
    TransferState state() const;
    TransferStats stats() const;
    std::string error() const;  // "transfer with 'peer' failed: reason", or empty
    // Returns once DONE; throws the failure (TransferError/PeerError) once FAILED, or
    // TimeoutError when timeout_seconds pass first.
    void wait(double timeout_seconds) const;

    // Called by the Agent.
    void posted(double post_seconds);
    void finish();
    void fail(ErrorKind kind, const std::string& reason);

private:
    void complete(TransferState state);

    const std::string peer_;
    const std::chrono::steady_clock::time_point start_;
    mutable std::mutex mu_;
    mutable std::condition_variable done_;
    TransferState state_ = TransferState::Pending;
    ErrorKind error_kind_ = ErrorKind::Transfer;
    std::string error_;
    TransferStats stats_;
};

}  // namespace kvmove
