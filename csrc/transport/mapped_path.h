// MappedPath: a same-host peer whose memory is mapped here (transport/peer_mapping.h). A batch
// is one copy job (transport/copier.h) into or out of the mapping instead of UCX puts/gets:
// no socket, no kernel copy, no CPU on the other side.
//
// Everything around the bytes stays as it is over UCX: messages (notifications, stream
// messages) go by the peer's UCX endpoint, which also reports the peer's death (error mode
// peer); a pidfd says so sooner (alive()). Only the flush is replaced: a job's completion
// stands in for it, in posting order (jobs_ is a FIFO), so a receiver never sees a message
// before the bytes it announces, and batches complete in the order they were posted, as
// flushes on one endpoint do.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/copier.h"
#include "transport/path.h"
#include "transport/peer_mapping.h"
#include "transport/ucx_path.h"

namespace kvmove {

class MappedPath : public Path {
public:
    // pid: the peer's process (for messages); copier: the agent's copy threads, started on
    // first use; wake: called by a copy thread when a job ends, so that the agent's progress
    // completes it without waiting to poll.
    MappedPath(std::shared_ptr<PeerMapping> mapping, uint32_t pid,
               std::unique_ptr<UcxPath> messages, std::function<Copier&()> copier,
               std::function<void()> wake);

    const char* kind() const override { return "mapped"; }
    ucp_ep_h endpoint() const override { return messages_->endpoint(); }
    std::vector<std::pair<std::string, std::string>> transports() const override {
        return messages_->transports();
    }
    void post(PathBatch batch, PathDone done) override;
    bool checksums_on_copy() const override { return true; }
    void send(unsigned am_id, std::string message, bool rendezvous, PathDone done) override {
        messages_->send(am_id, std::move(message), rendezvous, std::move(done));
    }
    bool poll(double now) override;
    bool alive(std::string& why) const override;
    void cancel() override;
    void cancel_lease(uint64_t lease) override;
    void close(bool force, double timeout_seconds) override;

private:
    struct Posted {
        std::shared_ptr<CopyJob> job;
        PathDone done;
        uint64_t lease;  // PathBatch::lease
    };

    std::shared_ptr<PeerMapping> mapping_;  // null once cancelled (each job holds it too)
    const uint32_t pid_;
    std::unique_ptr<UcxPath> messages_;
    std::function<Copier&()> copier_;
    std::function<void()> wake_;
    std::deque<Posted> jobs_;  // in posting order
};

}  // namespace kvmove
