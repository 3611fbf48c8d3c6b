#include "stream/stream_protocol.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "cuda/cuda_event.h"
#include "memory/block_checksum.h"
#include "stream/stream_protocol_internal.h"

namespace kvmove {

StreamProtocol::StreamProtocol(StreamPort& port, const KVGeometry& local, uint32_t incarnation,
                               StreamConfig config)
    : port_(port),
      local_(local),
      incarnation_(incarnation),
      config_(config),
      next_epoch_((uint64_t{incarnation} << 32) | 1) {}

StreamProtocol::~StreamProtocol() {
    stop_threads();
}

void StreamProtocol::check_open() const {
    KVMOVE_CHECK(!closed_, Config, "agent '" << port_.local_name() << "' is closed");
}

StreamStats StreamProtocol::stats() const {
    StreamStats out;
    port_.run_locked([&] {
        out = stats_;
        out.leases_active = leases_.size() + quarantined_.size();
        for (const auto& [epoch, lease] : leases_) {
            if (lease.phase == Lease::Phase::Cancelling) {
                out.blocks_quarantined += lease.load->local_ids().size();
            }
        }
        for (const auto& [epoch, q] : quarantined_) {
            out.blocks_quarantined += q.load->local_ids().size();
        }
    });
    out.checksum_mismatches = checksum_mismatches_;
    return out;
}

// Checksums of ids in layer: XXH3 of each block's bytes (memory/block_checksum.h), seeded with
// the lease, layer and position (layer_stream.h). Reads memory only: no lock.
std::vector<uint64_t> StreamProtocol::checksums_of(const std::vector<BlockId>& ids, int64_t layer,
                                                   uint64_t epoch) const {
    std::vector<uint64_t> out(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
        out[i] = block_checksum(local_, layer, ids[i], checksum_seed(epoch, layer, i));
    }
    return out;
}

void StreamProtocol::post_message(const std::string& peer, StreamMessage message) {
    outbox_.emplace_back(peer, std::move(message));  // sent by drain(): this is a callback
}

void StreamProtocol::refuse(const std::string& sender, const StreamMessage& m,
                            const std::string& why) {
    ++stats_.messages_refused;
    if (m.kind == MessageKind::Begin) {
        ++stats_.begins_refused;
        post_message(sender,
                     lease_message(MessageKind::Refuse, m.request_id, m.epoch, m.ids_hash, why));
    }
}

size_t StreamProtocol::answers_awaited() {
    if (sending_changed_) {
        sending_changed_ = false;
        answers_awaited_ = static_cast<size_t>(
            std::count_if(sending_.begin(), sending_.end(),
                          [](const auto& entry) { return entry.second.deadline != kNoDeadline; }));
    }
    return answers_awaited_;
}

void StreamProtocol::drain() {
    std::vector<std::pair<std::string, StreamMessage>> out;
    out.swap(outbox_);
    for (auto& [peer, message] : out) {
        if (port_.peer_alive(peer)) {
            port_.send(peer, encode(message), [](const PortOutcome&) {});
        }
    }
    send_held_aborts();
    std::vector<std::shared_ptr<SaveStream>> due;
    due.swap(ending_);
    for (const auto& stream : due) {
        send_end(stream);
    }
}

// Outside the transport's callbacks (drain, tick).
void StreamProtocol::send_held_aborts() {
    for (auto it = held_aborts_.begin(); it != held_aborts_.end();) {
        if (!port_.peer_alive(it->first)) {
            it = held_aborts_.erase(it);  // gone: its next run is told anew (peer_added)
        } else if (port_.peer_quiet(it->first)) {
            port_.send(it->first, encode(it->second), [](const PortOutcome&) {});
            it = held_aborts_.erase(it);
        } else {
            ++it;
        }
    }
}

void StreamProtocol::on_message(const std::string& sender, const void* data, size_t nbytes) {
    StreamMessage m;
    try {
        m = decode_stream_message(data, nbytes);
    } catch (const Error& e) {
        // Nobody to raise to inside the transport's callback: a malformed message is dropped,
        // loudly.
        ++stats_.messages_refused;
        KVMOVE_LOG(Warning, "stream",
                   "agent '" << port_.local_name() << "' dropped a stream message from '" << sender
                             << "': " << e.what());
        return;
    }
    switch (m.kind) {
        case MessageKind::Go:
            return on_go(sender, m);
        case MessageKind::Refuse:
            return on_refuse(sender, m);
        case MessageKind::Ack:
            return on_ack(sender, m);
        case MessageKind::Cancel:
            return on_cancel(sender, m);
        case MessageKind::Begin:
            return on_begin(sender, m);
        case MessageKind::Offer:
            return on_offer(sender, m);
        case MessageKind::Abort:
            if (on_quarantined_abort(sender, m)) {
                return;
            }
            break;
        default:
            break;
    }
    Lease* lease = lease_of(sender, m);
    if (lease == nullptr) {
        return;
    }
    if (m.kind == MessageKind::Decline) {
        return on_decline(*lease, m);
    }
    if (lease->phase == Lease::Phase::Granted) {
        refuse(sender, m, "lease " + std::to_string(m.epoch) + " was never engaged");
        return;
    }
    if (m.kind == MessageKind::Layer) {
        if (lease->phase == Lease::Phase::Engaged) {
            on_layer(*lease, m);
        }
    } else if (m.kind == MessageKind::Final) {
        on_final(*lease, m);
    } else if (m.kind == MessageKind::Abort) {
        lease->load->set_released();  // the sender flushed every put before its Abort
        lease->load->complete(StreamState::Aborted);
        release(m.epoch);
    }
}

// ---- both -----------------------------------------------------------------------------

void StreamProtocol::tick(double now) {
    if (!quarantined_.empty() && now >= next_quarantine_check_) {  // ticks come every 1 ms
        next_quarantine_check_ = now + kQuarantinePollSeconds;
        end_quarantines();
        cancel_quarantined(now);
    }
    send_held_aborts();
    std::vector<uint64_t> expired;
    std::vector<std::string> silent;
    for (auto& [epoch, lease] : leases_) {
        if (lease.phase != Lease::Phase::Cancelling && now >= lease.deadline) {
            expired.push_back(epoch);
        } else if (lease.phase == Lease::Phase::Cancelling && now >= lease.cancel_deadline) {
            silent.push_back(lease.load->peer());
        }
    }
    for (uint64_t epoch : expired) {
        auto it = leases_.find(epoch);
        if (it == leases_.end()) {
            continue;
        }
        ++stats_.leases_expired;
        const std::shared_ptr<LoadStream> load = it->second.load;
        end_lease(
            it->second, StreamState::Failed, ErrorKind::Timeout,
            "the lease of " + describe(load->request_id(), load->peer()) +
                " expired: not complete by its deadline (" +
                (it->second.phase == Lease::Phase::Granted
                     ? std::string("no Begin from the sender arrived")
                     : "the sender began; " + std::to_string(load->num_layers_landed()) + " of " +
                           std::to_string(load->num_layers()) + " layers landed, no Final") +
                ")");
    }
    std::sort(silent.begin(), silent.end());
    silent.erase(std::unique(silent.begin(), silent.end()), silent.end());
    for (const std::string& peer : silent) {
        ++stats_.senders_disconnected;
        port_.disconnect(peer, "it did not answer a Cancel within " +
                                   std::to_string(config_.cancel_timeout_seconds) + " s");
    }
    for (auto it = sending_.begin(); it != sending_.end();) {
        if (now >= it->second.deadline) {
            const std::shared_ptr<SaveStream>& s = it->second.stream;
            const bool begun = s->answered();
            stats_.acks_missed += begun ? 1 : 0;
            s->complete(
                StreamState::Failed, ErrorKind::Timeout,
                (begun ? "no acknowledgement of the Final of " : "no answer to the Begin of ") +
                    describe(s->request_id(), s->peer()) + " within " +
                    std::to_string(config_.ack_timeout_seconds) + " s" +
                    (begun ? ""
                     : it->second.begin_sent
                         ? " (nothing was written; the Begin was sent)"
                         : " (nothing was written; the Begin is still unsent here: behind "
                           "earlier transfers to that peer, or not taken by UCX)"));
            it = sending_.erase(it);
            sending_changed_ = true;
        } else {
            ++it;
        }
    }
}

// While the run a lease is quarantined for is a live peer again, it is asked to cancel the
// lease every kQuarantineCancelSeconds until its Abort comes (a Cancel sent as it reconnects
// may reach it before it added us, and be dropped there).
void StreamProtocol::cancel_quarantined(double now) {
    for (auto& [epoch, q] : quarantined_) {
        const std::string& peer = q.load->peer();
        if (now >= q.next_cancel && port_.peer_alive(peer) &&
            port_.peer_run(peer) == q.incarnation) {
            q.next_cancel = now + kQuarantineCancelSeconds;
            post_message(peer, lease_message(MessageKind::Cancel, q.load->request_id(), epoch,
                                             q.load->ids_hash()));
        }
    }
}

// An Abort of a quarantined lease by the run it was quarantined for: nothing of it is in
// flight there any more. True when m was such an Abort.
bool StreamProtocol::on_quarantined_abort(const std::string& sender, const StreamMessage& m) {
    auto it = quarantined_.find(m.epoch);
    if (it == quarantined_.end()) {
        return false;
    }
    const Quarantined& q = it->second;
    if (q.load->peer() != sender || q.incarnation != port_.peer_run(sender) ||
        q.load->ids_hash() != m.ids_hash || q.load->request_id() != m.request_id) {
        return false;
    }
    q.load->set_released();
    quarantined_.erase(it);
    return true;
}

// Quarantined leases whose sender's process exited: nothing of theirs can land any more.
void StreamProtocol::end_quarantines() {
    for (auto it = quarantined_.begin(); it != quarantined_.end();) {
        if (it->second.sender != nullptr && it->second.sender->exited()) {
            it->second.load->set_released();
            it = quarantined_.erase(it);
        } else {
            ++it;
        }
    }
}

double StreamProtocol::next_deadline() const {
    double next = kNoDeadline;
    if (!quarantined_.empty()) {  // watched, or asked again once its run is back
        next = steady_seconds() + kQuarantinePollSeconds;
    }
    for (const auto& [epoch, lease] : leases_) {
        next = std::min(
            next, lease.phase == Lease::Phase::Cancelling ? lease.cancel_deadline : lease.deadline);
    }
    for (const auto& [key, sending] : sending_) {
        next = std::min(next, sending.deadline);
    }
    if (!held_aborts_.empty()) {
        next = std::min(next, steady_seconds() + kQuarantinePollSeconds);
    }
    return next;
}

void StreamProtocol::peer_failed(const std::string& peer, ErrorKind kind,
                                 const std::string& reason) {
    for (auto it = sending_.begin(); it != sending_.end();) {
        if (it->first.first == peer) {
            const std::shared_ptr<SaveStream>& s = it->second.stream;
            s->complete(StreamState::Failed, kind,
                        "stream of " + describe(s->request_id(), peer) + " failed: " + reason);
            it = sending_.erase(it);
            sending_changed_ = true;
        } else {
            ++it;
        }
    }
    const std::shared_ptr<const ProcessWatch> process = port_.peer_process(peer);
    for (auto it = leases_.begin(); it != leases_.end();) {
        if (it->second.load->peer() == peer) {
            const std::shared_ptr<LoadStream>& load = it->second.load;
            if (it->second.phase == Lease::Phase::Granted ||
                (process != nullptr && process->exited())) {
                load->set_released();  // never written, or its writer is dead
            } else {
                quarantined_.emplace(it->first,
                                     Quarantined{load, process, port_.peer_run(peer), 0.0});
                ++stats_.leases_quarantined;
            }
            load->complete(StreamState::Failed, kind,
                           "load of " + describe(load->request_id(), peer) + " failed: " + reason);
            it = leases_.erase(it);
        } else {
            ++it;
        }
    }
    outbox_.erase(std::remove_if(outbox_.begin(), outbox_.end(),
                                 [&](const auto& entry) { return entry.first == peer; }),
                  outbox_.end());
    offers_.forget(peer);
}

void StreamProtocol::stop_threads() {
    closed_ = true;
    offers_.close();  // wakes wait_offer() callers: nothing more will come
    {
        std::lock_guard<std::mutex> lock(post_mu_);
        post_stop_ = true;
    }
    post_cv_.notify_all();
    if (post_thread_.joinable()) {
        post_thread_.join();
    }
    {
        std::lock_guard<std::mutex> lock(verify_mu_);
        verify_stop_ = true;
    }
    verify_cv_.notify_all();
    if (verify_thread_.joinable()) {
        verify_thread_.join();
    }
}

void StreamProtocol::close(const std::string& reason) {
    closed_ = true;
    for (auto& [key, sending] : sending_) {
        sending.stream->complete(StreamState::Failed, ErrorKind::Transfer,
                                 "stream of " + describe(sending.stream->request_id(), key.first) +
                                     " failed: " + reason);
    }
    for (auto& [epoch, lease] : leases_) {
        lease.load->set_released();  // the agent's connections are closed
        lease.load->complete(StreamState::Failed, ErrorKind::Transfer,
                             "load of " + describe(lease.load->request_id(), lease.load->peer()) +
                                 " failed: " + reason);
    }
    // The agent's connections are closed and its memory deregistered; what a sender that was
    // cut off may still do to the cache's memory is the owner's to weigh once it closed it.
    for (auto& [epoch, q] : quarantined_) {
        q.load->set_released();
    }
    sending_.clear();
    sending_changed_ = true;
    leases_.clear();
    quarantined_.clear();
    ending_.clear();
    outbox_.clear();
    held_aborts_.clear();
}

}  // namespace kvmove
