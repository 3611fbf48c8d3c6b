#include "transport/transfer.h"

#include <iomanip>
#include <sstream>

namespace kvmove {

std::vector<RmaOp> plan_ops(const std::vector<BlockId>& local_ids,
                            const std::vector<BlockId>& remote_ids,
                            const std::vector<int64_t>& layers, const CacheGeometry& local,
                            const CacheGeometry& remote) {
    // (local start, remote start, blocks) of runs consecutive on both sides.
    struct Run {
        BlockId local, remote;
        int64_t num;
    };
    std::vector<Run> runs;
    for (size_t i = 0; i < local_ids.size(); ++i) {
        if (!runs.empty() && runs.back().local + runs.back().num == local_ids[i] &&
            runs.back().remote + runs.back().num == remote_ids[i]) {
            ++runs.back().num;
        } else {
            runs.push_back({local_ids[i], remote_ids[i], 1});
        }
    }
    const uint64_t nbytes = local.block_nbytes;
    std::vector<RmaOp> ops;
    ops.reserve(runs.size() * layers.size());
    for (int64_t layer : layers) {
        for (const Run& run : runs) {
            RmaOp op{local.base_addr + (layer * local.num_blocks + run.local) * nbytes,
                     remote.base_addr + (layer * remote.num_blocks + run.remote) * nbytes,
                     run.num * nbytes};
            RmaOp* last = ops.empty() ? nullptr : &ops.back();
            if (last != nullptr && last->local_addr + last->nbytes == op.local_addr &&
                last->remote_addr + last->nbytes == op.remote_addr) {
                last->nbytes += op.nbytes;
            } else {
                ops.push_back(op);
            }
        }
    }
    return ops;
}

Transfer::Transfer(std::string peer, uint64_t nbytes, uint64_t num_ops)
    : peer_(std::move(peer)), start_(std::chrono::steady_clock::now()) {
    stats_.nbytes = nbytes;
    stats_.num_ops = num_ops;
}

TransferState Transfer::state() const {
    std::lock_guard<std::mutex> lock(mu_);
    return state_;
}

TransferStats Transfer::stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
}

std::string Transfer::error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
}

void Transfer::wait(double timeout_seconds) const {
    check_timeout(timeout_seconds);
    std::unique_lock<std::mutex> lock(mu_);
    bool finished = done_.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
                                   [this] { return state_ != TransferState::Pending; });
    KVMOVE_CHECK(finished, Timeout,
                 "transfer with '" << peer_ << "' still pending after " << timeout_seconds
                                   << " s (" << stats_.nbytes << " bytes in " << stats_.num_ops
                                   << " ops)");
    if (state_ == TransferState::Failed) {
        throw Error(error_kind_, error_);
    }
}

void Transfer::posted(double post_seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.post_seconds = post_seconds;
}

void Transfer::finish() { complete(TransferState::Done); }

void Transfer::fail(ErrorKind kind, const std::string& reason) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ != TransferState::Pending) {
            return;
        }
        error_kind_ = kind;
        error_ = "transfer with '" + peer_ + "' failed: " + reason;
    }
    complete(TransferState::Failed);
}

void Transfer::complete(TransferState state) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ != TransferState::Pending) {
            return;
        }
        state_ = state;
        stats_.complete_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    }
    done_.notify_all();
}

}  // namespace kvmove
