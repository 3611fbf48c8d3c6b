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
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
    std::unique_lock<std::mutex> lock(mu_);
    std::shared_ptr<Driver> driver = driver_.lock();
    if (driver && state_ == TransferState::Pending) {
        lock.unlock();
        driver->progress_until([this] { return state() != TransferState::Pending; },
                               timeout_seconds);
        lock.lock();
    }
    bool finished =
        cv_.wait_until(lock, until, [this] { return state_ != TransferState::Pending; });
    KVMOVE_CHECK(finished, Timeout,
                 "transfer with '" << peer_ << "' still pending after " << timeout_seconds << " s ("
                                   << stats_.nbytes << " bytes in " << stats_.num_ops << " ops)");
    if (state_ == TransferState::Failed) {
        throw Error(error_kind_, error_);
    }
}

void Transfer::drive_with(std::weak_ptr<Driver> driver) {
    std::lock_guard<std::mutex> lock(mu_);
    driver_ = std::move(driver);
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
