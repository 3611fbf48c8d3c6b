// StreamProtocol, the receiver's side: leases, their offers, and what lands in them
// (stream_protocol.h has the protocol).
#include <algorithm>

#include "common/log.h"
#include "stream/stream_protocol.h"
#include "stream/stream_protocol_internal.h"

namespace kvmove {

// ---- receiver -------------------------------------------------------------------------

namespace {

// Throws unless local_ids may be leased for request_id, for lease_seconds: each id in range,
// none twice.
void check_lease(const KVGeometry& local, const std::string& request_id,
                 const std::vector<BlockId>& local_ids, double lease_seconds) {
    check_request_id(request_id);
    check_timeout(lease_seconds);
    local.check_ids(local_ids, "local");
    std::vector<BlockId> sorted = local_ids;
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    KVMOVE_CHECK(dup == sorted.end(), Block,
                 "destination block " << (dup == sorted.end() ? 0 : *dup)
                                      << " appears twice: each may be written once per transfer");
}

}  // namespace

std::shared_ptr<LoadStream> StreamProtocol::expect(const std::string& peer,
                                                   const std::string& request_id,
                                                   const std::vector<BlockId>& local_ids,
                                                   double lease_seconds) {
    check_lease(local_, request_id, local_ids, lease_seconds);
    std::shared_ptr<LoadStream> load;
    port_.run_locked([&] { load = grant(peer, request_id, local_ids, lease_seconds); });
    return load;
}

// Locked. A new lease of local_ids (checked) to peer.
std::shared_ptr<LoadStream> StreamProtocol::grant(const std::string& peer,
                                                  const std::string& request_id,
                                                  const std::vector<BlockId>& local_ids,
                                                  double lease_seconds) {
    check_open();
    port_.check_sender(peer);
    for (const auto& [epoch, lease] : leases_) {
        KVMOVE_CHECK(lease.load->peer() != peer || lease.load->request_id() != request_id, Config,
                     describe(request_id, peer) << " already has lease " << epoch);
    }
    const uint64_t epoch = next_epoch_++;
    auto load =
        std::make_shared<LoadStream>(this, peer, request_id, local_ids, local_.num_layers(), epoch);
    leases_.emplace(
        epoch, Lease{load, Lease::Phase::Granted, steady_seconds() + lease_seconds, kNoDeadline});
    ++stats_.leases_granted;
    return load;
}

std::shared_ptr<LoadStream> StreamProtocol::offer(const std::string& peer,
                                                  const std::string& request_id,
                                                  const std::vector<BlockId>& local_ids,
                                                  double lease_seconds) {
    check_lease(local_, request_id, local_ids, lease_seconds);
    KVMOVE_CHECK(!local_ids.empty(), Config,
                 "an offer of " << describe(request_id, peer)
                                << " needs blocks (offer_nothing says none are needed)");
    std::shared_ptr<LoadStream> load;
    port_.run_locked([&] {
        load = grant(peer, request_id, local_ids, lease_seconds);
        load->mark_started();
        const uint64_t epoch = load->epoch();
        StreamMessage message =
            lease_message(MessageKind::Offer, request_id, epoch, load->ids_hash());
        message.block_ids = local_ids;
        port_.send(peer, encode(message), [this, epoch](const PortOutcome& o) {
            auto it = leases_.find(epoch);
            if (!o.ok && it != leases_.end()) {
                const std::shared_ptr<LoadStream> lost = it->second.load;
                end_lease(
                    it->second, StreamState::Failed, o.kind,
                    "cannot offer " + describe(lost->request_id(), lost->peer()) + ": " + o.error);
            }
        });
    });
    return load;
}

void StreamProtocol::offer_nothing(const std::string& peer, const std::string& request_id) {
    check_request_id(request_id);
    port_.run_locked([&] {
        check_open();
        KVMOVE_CHECK(port_.peer_alive(peer), Peer,
                     "cannot tell '" << peer << "' that " << describe(request_id, peer)
                                     << " needs no KV: it is no live peer");
        port_.send(peer, encode(lease_message(MessageKind::Offer, request_id, 0, 0)),
                   [](const PortOutcome&) {});
    });
}

// The sender will not write the lease: it ends now, and as nobody engaged it its blocks are
// free at once.
void StreamProtocol::on_decline(Lease& lease, const StreamMessage& m) {
    if (lease.phase != Lease::Phase::Granted) {
        // It said Begin: from now on only an Abort ends the lease (its puts may be in flight).
        ++stats_.messages_refused;
        return;
    }
    const std::shared_ptr<LoadStream> load = lease.load;
    end_lease(
        lease, StreamState::Failed, ErrorKind::Transfer,
        describe(load->request_id(), load->peer()) + " was declined by its sender: " + m.payload);
}

void StreamProtocol::start_load(LoadStream& load) {
    port_.run_locked([&] {
        check_open();
        load.check_startable();
        port_.check_sender(load.peer());  // a dead sender will send nothing: fail now
        load.mark_started();
    });
}

void StreamProtocol::cancel_load(LoadStream& load) {
    port_.run_locked([&] {
        auto it = leases_.find(load.epoch());
        if (it == leases_.end() || it->second.load.get() != &load) {
            load.complete(
                StreamState::Failed, ErrorKind::Transfer,
                describe(load.request_id(), load.peer()) + " was cancelled by the receiver");
            return;  // already released
        }
        end_lease(it->second, StreamState::Failed, ErrorKind::Transfer,
                  describe(load.request_id(), load.peer()) + " was cancelled by the receiver");
    });
}

// The lease's load ends now (waiters wake). Its blocks: released at once when no sender
// engaged it; else the sender is asked to stop, and they are released when it answers.
void StreamProtocol::end_lease(Lease& lease, StreamState state, ErrorKind kind,
                               const std::string& error) {
    if (lease.phase == Lease::Phase::Granted) {
        lease.load->set_released();  // nobody engaged it; before the end wakes the waiters
    }
    lease.load->complete(state, kind, error);
    if (lease.phase == Lease::Phase::Granted) {
        release(lease.load->epoch());
    } else if (lease.phase == Lease::Phase::Engaged) {
        lease.phase = Lease::Phase::Cancelling;
        lease.cancel_deadline = steady_seconds() + config_.cancel_timeout_seconds;
        ++stats_.cancels_sent;
        post_message(lease.load->peer(),
                     lease_message(MessageKind::Cancel, lease.load->request_id(),
                                   lease.load->epoch(), lease.load->ids_hash()));
    }
}

void StreamProtocol::release(uint64_t epoch) {
    auto it = leases_.find(epoch);
    if (it != leases_.end()) {
        it->second.load->set_released();
        leases_.erase(it);
    }
}

// The lease m is about, if m may act on it; else m is refused (and counted).
StreamProtocol::Lease* StreamProtocol::lease_of(const std::string& sender, const StreamMessage& m) {
    auto it = leases_.find(m.epoch);
    if (it == leases_.end()) {
        refuse(sender, m,
               "no lease " + std::to_string(m.epoch) +
                   " (never granted, expired, cancelled or already ended)");
        return nullptr;
    }
    Lease& lease = it->second;
    if (lease.load->peer() != sender) {
        refuse(sender, m,
               "lease " + std::to_string(m.epoch) + " is for '" + lease.load->peer() + "', not '" +
                   sender + "'");
        return nullptr;
    }
    if (m.ids_hash != lease.load->ids_hash() || m.request_id != lease.load->request_id()) {
        refuse(sender, m,
               "lease " + std::to_string(m.epoch) + " is " +
                   describe(lease.load->request_id(), sender) +
                   " into other blocks (ids or request id differ)");
        return nullptr;
    }
    return &lease;
}

void StreamProtocol::on_begin(const std::string& sender, const StreamMessage& m) {
    Lease* lease = lease_of(sender, m);
    if (lease == nullptr) {
        return;
    }
    if (lease->phase != Lease::Phase::Granted) {
        refuse(sender, m, "lease " + std::to_string(m.epoch) + " was already engaged");
        return;
    }
    lease->phase = Lease::Phase::Engaged;
    post_message(sender, lease_message(MessageKind::Go, m.request_id, m.epoch, m.ids_hash));
}

void StreamProtocol::on_layer(Lease& lease, const StreamMessage& m) {
    const std::shared_ptr<LoadStream>& load = lease.load;
    if (m.layer >= static_cast<uint64_t>(load->num_layers()) ||
        (!m.checksums.empty() && m.checksums.size() != load->local_ids().size())) {
        ++stats_.messages_refused;
        end_lease(lease, StreamState::Failed, ErrorKind::Transfer,
                  "sender '" + load->peer() + "' sent layer " + std::to_string(m.layer) +
                      " of request '" + load->request_id() + "' with " +
                      std::to_string(m.checksums.size()) + " checksums; layers are in [0, " +
                      std::to_string(load->num_layers()) + "), checksums 0 or " +
                      std::to_string(load->local_ids().size()));
        return;
    }
    const auto layer = static_cast<int64_t>(m.layer);
    load->layer_landed(layer, m.checksums.empty());
    if (!m.checksums.empty()) {
        {
            std::lock_guard<std::mutex> lock(verify_mu_);
            if (verify_stop_) {
                return;
            }
            to_verify_.push_back(Verify{load, layer, m.checksums});
            if (!verify_thread_.joinable()) {
                verify_thread_ = std::thread([this] { verify_loop(); });
            }
        }
        verify_cv_.notify_one();
    }
}

void StreamProtocol::on_final(Lease& lease, const StreamMessage& m) {
    const std::shared_ptr<LoadStream>& load = lease.load;
    post_message(load->peer(), lease_message(MessageKind::Ack, m.request_id, m.epoch, m.ids_hash));
    load->set_released();  // the sender flushed every put before its Final
    load->final_arrived(m.payload);
    release(m.epoch);
}

void StreamProtocol::verify_loop() {
    threads_cpus_.apply();
    while (true) {
        Verify job;
        {
            std::unique_lock<std::mutex> lock(verify_mu_);
            verify_cv_.wait(lock, [this] { return verify_stop_ || !to_verify_.empty(); });
            if (verify_stop_) {
                return;
            }
            job = std::move(to_verify_.front());
            to_verify_.pop_front();
        }
        if (job.load->state() != StreamState::Open) {
            continue;  // cancelled or failed: its blocks may already be someone else's
        }
        std::vector<uint64_t> actual =
            checksums_of(job.load->local_ids(), job.layer, job.load->epoch());
        std::vector<size_t> bad;
        for (size_t i = 0; i < actual.size(); ++i) {
            if (actual[i] != job.checksums[i]) {
                bad.push_back(i);
            }
        }
        checksum_mismatches_ += bad.size();
        job.load->layer_verified(job.layer, bad);
    }
}

}  // namespace kvmove
