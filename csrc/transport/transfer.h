// Transfer: one batch of block copies to or from a peer, its state, stats and completion.
//
// The Agent posts a transfer's operations in one go and then one flush; the transfer is DONE
// when the flush (and the notification, if any) completes, FAILED when either reports an
// error. wait() blocks without the GIL and always has a deadline.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/completion.h"
#include "common/errors.h"
#include "transport/driver.h"

namespace kvmove {

enum class TransferState { Pending, Done, Failed };

struct TransferStats {
    uint64_t nbytes = 0;
    uint64_t num_ops = 0;         // RMA operations posted after coalescing
    double post_seconds = 0;      // time spent posting them
    double complete_seconds = 0;  // from the first post to completion (0 while pending)
};

class Transfer : public Completion<TransferState, TransferState::Pending> {
public:
    Transfer(std::string peer, uint64_t nbytes, uint64_t num_ops);
    Transfer(const Transfer&) = delete;
    Transfer& operator=(const Transfer&) = delete;

    const std::string& peer() const { return peer_; }
    TransferStats stats() const;
    // error(): "transfer with 'peer' failed: reason", or empty.
    // Returns once DONE; throws the failure (TransferError/PeerError) once FAILED, or
    // TimeoutError when timeout_seconds pass first. With a driver, the waiting thread
    // progresses the transport itself while its agent is open.
    void wait(double timeout_seconds) const;

    // Called by the Agent.
    void drive_with(std::weak_ptr<Driver> driver);
    void posted(double post_seconds);
    void finish();
    void fail(ErrorKind kind, const std::string& reason);

private:
    void on_end_locked() override;

    const std::string peer_;
    const std::chrono::steady_clock::time_point start_;
    TransferStats stats_;
    std::weak_ptr<Driver> driver_;  // its agent's, while the agent lives
};

}  // namespace kvmove
