// The Agent's same-host mapped path: a transfer to a peer whose memory is mapped here
// (transport/peer_mapping.h) is one copy job (transport/copier.h) instead of UCX puts/gets.
//
// Everything around the bytes stays as it is over UCX: the entry is tracked in in_flight_,
// the peer's death is still learnt from its UCX endpoint (error mode peer), and the
// notification or stream message still goes by UCX active message. Only the flush is
// replaced: a job's completion stands in for it, in posting order (copying_ is a FIFO), so a
// receiver never sees a message before the bytes it announces, and messages keep the order
// of their transfers, as flushes on one endpoint do.
#include <algorithm>
#include <thread>

#include "common/log.h"
#include "transport/agent.h"
#include "transport/agent_internal.h"

namespace kvmove {

namespace {

// Transfers up to this size are copied by the posting thread at once: handing them to a copy
// thread and waking the progress thread afterwards costs more than the copy (a 32 KiB block
// copies in ~3 us).
constexpr uint64_t kInlineCopyBytes = 256 * 1024;

uint64_t total_nbytes(const std::vector<RangePair>& ranges) {
    uint64_t nbytes = 0;
    for (const RangePair& r : ranges) {
        nbytes += r.nbytes;
    }
    return nbytes;
}

}  // namespace

void Agent::map_peer(Peer& peer) {
    if (!config_.map_same_host || cache_.on_device()) {
        return;
    }
    std::string why;
    peer.mapping = PeerMapping::open(peer.meta, why);
    KVMOVE_LOG(Debug, "agent",
               "agent '" << name_ << "' reaches peer '" << peer.meta.name << "' "
                         << (peer.mapping ? "through its mapped memory" : "over UCX: " + why));
}

// A mapped peer whose process exited fails at once, as UCX's error callback would fail it.
void Agent::check_mapped_peers() {
    for (auto& [name, peer] : peers_) {
        if (peer->mapping && peer->failure.empty() && !peer->mapping->owner_alive()) {
            peer_failed(*peer, "its process " + std::to_string(peer->meta.host.pid) + " exited");
        }
    }
}

std::string Agent::peer_path(const std::string& name) const {
    WorkerLock lock(*this);
    auto it = peers_.find(name);
    KVMOVE_CHECK(it != peers_.end(), Peer,
                 "unknown peer '" << name << "' for agent '" << name_ << "'");
    return it->second->mapping ? "mapped" : "ucx";
}

Copier& Agent::copier() {
    if (!copier_) {
        // Auto: one copy thread per two CPUs, 2 to 4: a copy is bound by memory bandwidth,
        // which a few threads fill (the rest of the CPUs belong to the engine), and a second
        // thread helps even on 2 CPUs (measured there, 524 MB: 3.5-4.1 GB/s with one thread,
        // 4.6-5.9 with two). The threads sleep between transfers.
        const int cpus = static_cast<int>(std::thread::hardware_concurrency());
        const int auto_threads = std::clamp(cpus / 2, 2, 4);
        copier_ = std::make_unique<Copier>(
            config_.copy_threads > 0 ? config_.copy_threads : auto_threads, threads_cpus_);
    }
    return *copier_;
}

void Agent::post_copies(Direction direction, Peer& peer, const std::vector<RangePair>& ranges,
                        std::unique_ptr<InFlight> entry) {
    Transfer& transfer = *entry->transfer;
    if (faults_ && faults_->fail_post()) {
        transfer.fail(ErrorKind::Transfer, "posting failed (injected fault)");
        if (entry->on_done) {
            entry->on_done({false, ErrorKind::Transfer, transfer.error()});
        }
        return;
    }
    std::vector<CopyOp> ops;
    ops.reserve(ranges.size());
    for (const RangePair& r : ranges) {
        char* here = reinterpret_cast<char*>(r.here);
        char* there = peer.mapping->at(r.there_segment, r.there);
        ops.push_back(direction == Direction::Put ? CopyOp{there, here, r.nbytes}
                                                  : CopyOp{here, there, r.nbytes});
    }
    const bool inline_copy = total_nbytes(ranges) <= kInlineCopyBytes;
    std::function<void()> wake;
    if (!inline_copy) {
        ucp_worker_h worker = worker_.get();  // the copier stops before the worker goes
        wake = [worker] { ucp_worker_signal(worker); };
    }
    entry->copy = std::make_shared<CopyJob>(ops, peer.mapping, std::move(wake));
    std::shared_ptr<CopyJob> job = entry->copy;
    copying_.push_back(track(std::move(entry)));
    if (inline_copy) {
        job->run_all();
    } else {
        copier().submit(std::move(job));
    }
}

// Completes the mapped transfers whose copies are done, oldest first, as a flush would.
void Agent::drain_copies() {
    while (!copying_.empty() && copying_.front()->copy->done()) {
        InFlight* entry = copying_.front();
        copying_.pop_front();
        // Cancelled: its peer failed or went (the transfer is FAILED already). Through
        // complete_flush either way, which keeps the peer's notification order.
        const bool cancelled = entry->copy->cancelled() || entry->peer == nullptr;
        if (!cancelled && entry->corrupt_at != nullptr) {
            *entry->corrupt_at = *entry->corrupt_byte;  // fault injection, before the message
        }
        complete_flush(entry, cancelled ? UCS_ERR_CANCELED : UCS_OK);
    }
}

}  // namespace kvmove
