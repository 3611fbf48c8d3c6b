#include "transport/transfer.h"

#include <iomanip>
#include <sstream>

namespace kvmove {

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
                 "transfer with '" << peer_ << "' still pending after " << timeout_seconds << " s ("
                                   << stats_.nbytes << " bytes in " << stats_.num_ops << " ops)");
    if (state_ == TransferState::Failed) {
        throw Error(error_kind_, error_);
    }
}

void Transfer::posted(double post_seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.post_seconds = post_seconds;
}

void Transfer::finish() {
    complete(TransferState::Done);
}

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
