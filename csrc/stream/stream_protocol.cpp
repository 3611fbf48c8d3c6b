#include "stream/stream_protocol.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>

#include "common/log.h"
#include "common/xxh64.h"
#include "cuda/cuda_event.h"

namespace kvmove {

namespace {

constexpr double kNoDeadline = std::numeric_limits<double>::infinity();

std::string describe(const std::string& request_id, const std::string& peer) {
    return "request '" + request_id + "' with '" + peer + "'";
}

void check_request_id(const std::string& request_id) {
    KVMOVE_CHECK(!request_id.empty() && request_id.size() <= kMaxRequestIdBytes, Config,
                 "request_id must be 1.." << kMaxRequestIdBytes << " bytes, got "
                                          << request_id.size());
}

}  // namespace

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
        out.leases_active = leases_.size();
        for (const auto& [epoch, lease] : leases_) {
            if (lease.phase == Lease::Phase::Cancelling) {
                out.blocks_quarantined += lease.load->local_ids().size();
            }
        }
    });
    out.checksum_mismatches = checksum_mismatches_;
    return out;
}

// Checksums of ids in layer: XXH64 of each block's bytes, seeded with the lease, layer and
// position (layer_stream.h). The bytes are the block's parts read one after the other, hashed
// as one range: peers that split a block differently (K and V apart on one side, together on
// the other) must agree, so a block of two parts is gathered first. Reads memory only: no lock.
std::vector<uint64_t> StreamProtocol::checksums_of(const std::vector<BlockId>& ids,
                                                   int64_t layer, uint64_t epoch) const {
    std::vector<uint64_t> out(ids.size());
    std::vector<char> block(local_.num_parts() > 1 ? local_.block_nbytes() : 0);
    for (size_t i = 0; i < ids.size(); ++i) {
        const uint64_t seed = checksum_seed(epoch, layer, i);
        if (local_.num_parts() == 1) {
            const Plane& plane = local_.plane(layer, 0);
            out[i] = xxh64(reinterpret_cast<const void*>(block_address(plane, ids[i])),
                           plane.block_nbytes, seed);
            continue;
        }
        char* at = block.data();
        for (int64_t part = 0; part < local_.num_parts(); ++part) {
            const Plane& plane = local_.plane(layer, part);
            std::memcpy(at, reinterpret_cast<const void*>(block_address(plane, ids[i])),
                        plane.block_nbytes);
            at += plane.block_nbytes;
        }
        out[i] = xxh64(block.data(), block.size(), seed);
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
        post_message(sender, StreamMessage{MessageKind::Refuse, m.request_id, 0, m.epoch,
                                           m.ids_hash, {}, why});
    }
}

// ---- sender ---------------------------------------------------------------------------

std::shared_ptr<SaveStream> StreamProtocol::stream_to(const std::string& peer,
                                                      const std::vector<BlockId>& local_ids,
                                                      const std::vector<BlockId>& remote_ids,
                                                      const std::string& request_id,
                                                      uint64_t epoch, bool checksums) {
    check_request_id(request_id);
    std::shared_ptr<SaveStream> stream;
    port_.run_locked([&] {
        check_open();
        port_.check_put(peer, local_ids, remote_ids);
        const uint32_t theirs = port_.peer_incarnation(peer);
        KVMOVE_CHECK(epoch >> 32 == theirs, Peer,
                     "epoch " << epoch << " is not a lease of '" << peer << "' (incarnation "
                              << theirs << "): it came from an earlier run of that agent, or "
                              << "from another one");
        KVMOVE_CHECK(sending_.count({peer, epoch}) == 0, Config,
                     "lease " << epoch << " of '" << peer << "' is already being streamed");
        stream = std::make_shared<SaveStream>(this, peer, local_ids, remote_ids, request_id,
                                              local_.num_layers(), epoch, checksums);
        // The Begin's answer has the ack timeout too: a lost Begin must not leave the stream
        // waiting for ever (nothing is written before the answer).
        sending_.emplace(SendKey{peer, epoch},
                         Sending{stream, steady_seconds() + config_.ack_timeout_seconds});
        // Ask first: nothing is written before the receiver's Go.
        port_.send(peer,
                   encode(StreamMessage{MessageKind::Begin, request_id, 0, epoch,
                                        stream->ids_hash(), {}, ""}),
                   [this, stream](const PortOutcome& o) {
                       if (!o.ok && stream->complete(StreamState::Failed, o.kind,
                                                     "cannot ask '" + stream->peer() +
                                                         "' for its lease: " + o.error)) {
                           forget(*stream);
                       }
                   });
    });
    return stream;
}

void StreamProtocol::queue_layer(std::shared_ptr<SaveStream> stream, int64_t layer,
                                 uintptr_t cuda_event) {
    queue(Pending{Pending::Kind::Layer, std::move(stream), layer, cuda_event});
}

void StreamProtocol::queue_end(std::shared_ptr<SaveStream> stream) {
    queue(Pending{Pending::Kind::End, std::move(stream), 0, 0});
}

void StreamProtocol::queue(Pending pending) {
    KVMOVE_CHECK(try_queue(std::move(pending)), Config,
                 "agent '" << port_.local_name() << "' is closed");
}

// False once the post thread stopped (closing): what was saved then is never posted.
bool StreamProtocol::try_queue(Pending pending) {
    {
        std::lock_guard<std::mutex> lock(post_mu_);
        if (post_stop_) {
            return false;
        }
        to_post_.push_back(std::move(pending));
        if (!post_thread_.joinable()) {
            post_thread_ = std::thread([this] { post_loop(); });
        }
    }
    post_cv_.notify_one();
    return true;
}

void StreamProtocol::post_loop() {
    threads_cpus_.apply();
    while (true) {
        Pending pending;
        {
            std::unique_lock<std::mutex> lock(post_mu_);
            post_cv_.wait(lock, [this] { return post_stop_ || !to_post_.empty(); });
            if (post_stop_) {
                return;
            }
            pending = std::move(to_post_.front());
            to_post_.pop_front();
        }
        std::string cuda_error;
        try {
            while (pending.event != 0 && !cuda_event_done(pending.event)) {
                {
                    std::lock_guard<std::mutex> lock(post_mu_);
                    if (post_stop_) {
                        return;
                    }
                }
                std::this_thread::yield();
            }
        } catch (const Error& e) {
            cuda_error = e.what();
        }
        const std::shared_ptr<SaveStream>& s = pending.stream;
        if (pending.kind == Pending::Kind::End) {
            port_.run_locked([&] { send_end(s); });
        } else if (!cuda_error.empty()) {
            port_.run_locked(
                [&] { layer_result(s, pending.layer, {false, ErrorKind::Cuda, cuda_error}); });
        } else {
            if (const double delay = port_.post_delay_seconds(); delay > 0) {
                std::this_thread::sleep_for(std::chrono::duration<double>(delay));
            }
            // Hashed here, off the port's lock, while the forward pass goes on.
            std::vector<uint64_t> sums;
            if (s->checksums() && !s->was_cancelled()) {
                sums = checksums_of(s->local_ids(), pending.layer, s->epoch());
            }
            port_.run_locked([&] { post_layer(s, pending.layer, std::move(sums)); });
        }
    }
}

void StreamProtocol::post_layer(const std::shared_ptr<SaveStream>& s, int64_t layer,
                                std::vector<uint64_t> checksums) {
    if (s->was_cancelled()) {
        layer_result(s, layer, {false, ErrorKind::Transfer, "cancelled by the receiver"});
        return;
    }
    if (!port_.peer_alive(s->peer())) {
        layer_result(s, layer, {false, ErrorKind::Peer, "peer '" + s->peer() + "' is gone"});
        return;
    }
    s->record_posted(layer);
    StreamMessage message{MessageKind::Layer, s->request_id(), static_cast<uint32_t>(layer),
                          s->epoch(), s->ids_hash(), std::move(checksums), ""};
    port_.put_then_send(s->peer(), s->local_ids(), s->remote_ids(), layer, encode(message),
                        [this, s, layer](const PortOutcome& o) { layer_result(s, layer, o); });
}

// A layer landed (its Layer message is out) or failed; the stream may now end.
void StreamProtocol::layer_result(const std::shared_ptr<SaveStream>& s, int64_t layer,
                                  const PortOutcome& outcome) {
    if (s->layer_done(layer, outcome.ok, outcome.kind, outcome.error)) {
        ending_.push_back(s);  // sent by drain(): this may be a transport callback
    }
}

void StreamProtocol::drain() {
    std::vector<std::pair<std::string, StreamMessage>> out;
    out.swap(outbox_);
    for (auto& [peer, message] : out) {
        if (port_.peer_alive(peer)) {
            port_.send(peer, encode(message), [](const PortOutcome&) {});
        }
    }
    std::vector<std::shared_ptr<SaveStream>> due;
    due.swap(ending_);
    for (const auto& stream : due) {
        send_end(stream);
    }
}

void StreamProtocol::send_end(const std::shared_ptr<SaveStream>& s) {
    const bool finish = s->end() == StreamEnd::Finish;
    if (!port_.peer_alive(s->peer())) {
        if (finish) {
            s->complete(StreamState::Failed, ErrorKind::Peer,
                        "peer '" + s->peer() + "' is gone before " +
                            describe(s->request_id(), s->peer()) + " was delivered");
        } else {
            s->complete(StreamState::Aborted);  // no one left to tell
        }
        forget(*s);
        return;
    }
    StreamMessage message{finish ? MessageKind::Final : MessageKind::Abort,
                          s->request_id(),
                          0,
                          s->epoch(),
                          s->ids_hash(),
                          {},
                          finish ? s->payload() : ""};
    // Every posted layer's flush completed, so the message needs none of its own.
    port_.send(s->peer(), encode(message),
               [this, s](const PortOutcome& o) { end_sent(s, o); });
    auto it = sending_.find({s->peer(), s->epoch()});
    if (finish && it != sending_.end()) {
        it->second.deadline = steady_seconds() + config_.ack_timeout_seconds;
    }
}

void StreamProtocol::end_sent(const std::shared_ptr<SaveStream>& s, const PortOutcome& outcome) {
    if (!outcome.ok) {
        s->complete(StreamState::Failed, ErrorKind::Transfer,
                    "sending the end of " + describe(s->request_id(), s->peer()) +
                        " failed: " + outcome.error);
    } else if (s->end() == StreamEnd::Abort) {
        s->complete(StreamState::Aborted, ErrorKind::Transfer,
                    s->was_cancelled() ? describe(s->request_id(), s->peer()) +
                                             " was cancelled by its receiver"
                                       : "");
    } else {
        return;  // a Final: DONE when the receiver's Ack arrives
    }
    forget(*s);
}

// Drops an ended stream from sending_.
void StreamProtocol::forget(const SaveStream& s) {
    auto it = sending_.find({s.peer(), s.epoch()});
    if (it != sending_.end() && it->second.stream.get() == &s) {
        sending_.erase(it);
    }
}

void StreamProtocol::on_go(const std::string& sender, const StreamMessage& m) {
    auto it = sending_.find({sender, m.epoch});
    if (it == sending_.end()) {
        ++stats_.messages_refused;  // the stream ended meanwhile (aborted): nothing to do
        return;
    }
    std::shared_ptr<SaveStream> s = it->second.stream;
    it->second.deadline = kNoDeadline;  // answered: the next deadline is the Final's Ack
    for (const SavedLayer& saved : s->go()) {
        // A transport callback must not throw: closing, the layer is simply never posted.
        try_queue(Pending{Pending::Kind::Layer, s, saved.layer, saved.event});
    }
}

void StreamProtocol::on_refuse(const std::string& sender, const StreamMessage& m) {
    auto it = sending_.find({sender, m.epoch});
    if (it == sending_.end()) {
        ++stats_.messages_refused;
        return;
    }
    it->second.stream->refused(m.payload);
    sending_.erase(it);
}

void StreamProtocol::on_ack(const std::string& sender, const StreamMessage& m) {
    auto it = sending_.find({sender, m.epoch});
    if (it == sending_.end() || it->second.stream->end() != StreamEnd::Finish) {
        ++stats_.messages_refused;
        return;
    }
    it->second.stream->complete(StreamState::Done);
    sending_.erase(it);
}

void StreamProtocol::on_cancel(const std::string& sender, const StreamMessage& m) {
    auto it = sending_.find({sender, m.epoch});
    if (it == sending_.end()) {
        // Nothing of this lease is in flight here (the stream ended, or never began): say so.
        post_message(sender, StreamMessage{MessageKind::Abort, m.request_id, 0, m.epoch,
                                           m.ids_hash, {}, ""});
        return;
    }
    if (it->second.stream->cancelled()) {
        ending_.push_back(it->second.stream);  // no layer in flight: the Abort is due now
    } else if (it->second.stream->end() == StreamEnd::Finish) {
        // The Final went out (after every put landed), yet the receiver cancels: the Final was
        // lost or crossed the Cancel. Nothing is in flight: say so, or it would cut us off.
        post_message(sender, StreamMessage{MessageKind::Abort, m.request_id, 0, m.epoch,
                                           m.ids_hash, {}, ""});
    }
}

// ---- receiver -------------------------------------------------------------------------

std::shared_ptr<LoadStream> StreamProtocol::expect(const std::string& peer,
                                                   const std::string& request_id,
                                                   const std::vector<BlockId>& local_ids,
                                                   double lease_seconds) {
    check_request_id(request_id);
    check_timeout(lease_seconds);
    local_.check_ids(local_ids, "local");
    std::vector<BlockId> sorted = local_ids;
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    KVMOVE_CHECK(dup == sorted.end(), Block,
                 "destination block " << (dup == sorted.end() ? 0 : *dup)
                                      << " appears twice: each may be written once per transfer");
    std::shared_ptr<LoadStream> load;
    port_.run_locked([&] {
        check_open();
        port_.check_sender(peer);
        for (const auto& [epoch, lease] : leases_) {
            KVMOVE_CHECK(lease.load->peer() != peer || lease.load->request_id() != request_id,
                         Config,
                         describe(request_id, peer) << " already has lease " << epoch);
        }
        const uint64_t epoch = next_epoch_++;
        load = std::make_shared<LoadStream>(this, peer, request_id, local_ids,
                                            local_.num_layers(), epoch);
        leases_.emplace(epoch, Lease{load, Lease::Phase::Granted,
                                     steady_seconds() + lease_seconds, kNoDeadline});
        ++stats_.leases_granted;
    });
    return load;
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
            load.complete(StreamState::Failed, ErrorKind::Transfer,
                          describe(load.request_id(), load.peer()) +
                              " was cancelled by the receiver");
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
                     StreamMessage{MessageKind::Cancel, lease.load->request_id(), 0,
                                   lease.load->epoch(), lease.load->ids_hash(), {}, ""});
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
StreamProtocol::Lease* StreamProtocol::lease_of(const std::string& sender,
                                                const StreamMessage& m) {
    auto it = leases_.find(m.epoch);
    if (it == leases_.end()) {
        refuse(sender, m, "no lease " + std::to_string(m.epoch) +
                              " (never granted, expired, cancelled or already ended)");
        return nullptr;
    }
    Lease& lease = it->second;
    if (lease.load->peer() != sender) {
        refuse(sender, m, "lease " + std::to_string(m.epoch) + " is for '" + lease.load->peer() +
                              "', not '" + sender + "'");
        return nullptr;
    }
    if (m.ids_hash != lease.load->ids_hash() || m.request_id != lease.load->request_id()) {
        refuse(sender, m, "lease " + std::to_string(m.epoch) + " is " +
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
    post_message(sender, StreamMessage{MessageKind::Go, m.request_id, 0, m.epoch, m.ids_hash,
                                       {}, ""});
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
    post_message(load->peer(), StreamMessage{MessageKind::Ack, m.request_id, 0, m.epoch,
                                             m.ids_hash, {}, ""});
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

void StreamProtocol::on_message(const std::string& sender, const void* data, size_t nbytes) {
    StreamMessage m;
    try {
        m = decode_stream_message(data, nbytes);
    } catch (const Error& e) {
        // Nobody to raise to inside the transport's callback: a malformed message is dropped,
        // loudly.
        ++stats_.messages_refused;
        KVMOVE_LOG(Warning, "stream", "agent '" << port_.local_name()
                                                  << "' dropped a stream message from '"
                                                  << sender << "': " << e.what());
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
        default:
            break;
    }
    Lease* lease = lease_of(sender, m);
    if (lease == nullptr) {
        return;
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
        end_lease(it->second, StreamState::Failed, ErrorKind::Timeout,
                  "the lease of " + describe(load->request_id(), load->peer()) +
                      " expired: not complete by its deadline");
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
            s->complete(StreamState::Failed, ErrorKind::Timeout,
                        (begun ? "no acknowledgement of the Final of "
                               : "no answer to the Begin of ") +
                            describe(s->request_id(), s->peer()) + " within " +
                            std::to_string(config_.ack_timeout_seconds) + " s" +
                            (begun ? "" : " (nothing was written)"));
            it = sending_.erase(it);
        } else {
            ++it;
        }
    }
}

double StreamProtocol::next_deadline() const {
    double next = kNoDeadline;
    for (const auto& [epoch, lease] : leases_) {
        next = std::min(next, lease.phase == Lease::Phase::Cancelling ? lease.cancel_deadline
                                                                       : lease.deadline);
    }
    for (const auto& [key, sending] : sending_) {
        next = std::min(next, sending.deadline);
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
        } else {
            ++it;
        }
    }
    for (auto it = leases_.begin(); it != leases_.end();) {
        if (it->second.load->peer() == peer) {
            const std::shared_ptr<LoadStream>& load = it->second.load;
            load->set_released();  // the connection is gone: nothing more lands
            load->complete(StreamState::Failed, kind,
                           "load of " + describe(load->request_id(), peer) + " failed: " +
                               reason);
            it = leases_.erase(it);
        } else {
            ++it;
        }
    }
    outbox_.erase(std::remove_if(outbox_.begin(), outbox_.end(),
                                 [&](const auto& entry) { return entry.first == peer; }),
                  outbox_.end());
}

void StreamProtocol::stop_threads() {
    closed_ = true;
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
                             "load of " + describe(lease.load->request_id(),
                                                   lease.load->peer()) +
                                 " failed: " + reason);
    }
    sending_.clear();
    leases_.clear();
    ending_.clear();
    outbox_.clear();
}

}  // namespace kvmove
