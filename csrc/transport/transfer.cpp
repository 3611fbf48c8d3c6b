#include "transport/transfer.h"

#include <iomanip>
#include <sstream>

namespace kvmove {

Transfer::Transfer(std::string peer, uint64_t nbytes, uint64_t num_ops)
    : peer_(std::move(peer)), start_(std::chrono::steady_clock::now()) {
    stats_.nbytes = nbytes;
    stats_.num_ops = num_ops;
}

TransferStats Transfer::stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
}

void Transfer::wait(double timeout_seconds) const {
    check_timeout(timeout_seconds);
    std::unique_lock<std::mutex> lock(mu_);
    bool finished = cv_.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
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
    complete(TransferState::Failed, kind, "transfer with '" + peer_ + "' failed: " + reason);
}

void Transfer::on_end_locked() {
    stats_.complete_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

}  // namespace kvmove
