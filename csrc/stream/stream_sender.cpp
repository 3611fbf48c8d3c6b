// StreamProtocol, the sender's side: streams into a peer's lease, and the offers of leases
// that peers make (stream_protocol.h has the protocol).
#include <algorithm>
#include <optional>

#include "common/log.h"
#include "cuda/cuda_event.h"
#include "stream/stream_protocol.h"
#include "stream/stream_protocol_internal.h"

namespace kvmove {

// ---- sender ---------------------------------------------------------------------------

std::shared_ptr<SaveStream> StreamProtocol::stream_to(const std::string& peer,
                                                      const std::vector<BlockId>& local_ids,
                                                      const std::vector<BlockId>& remote_ids,
                                                      const std::string& request_id, uint64_t epoch,
                                                      bool checksums) {
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
        sending_changed_ = true;
        // Ask first: nothing is written before the receiver's Go.
        port_.send(peer,
                   encode(lease_message(MessageKind::Begin, request_id, epoch, stream->ids_hash())),
                   [this, stream, peer, epoch](const PortOutcome& o) {
                       if (o.ok) {
                           auto it = sending_.find(SendKey{peer, epoch});
                           if (it != sending_.end() && it->second.stream == stream) {
                               it->second.begin_sent = true;
                           }
                       }
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
            port_.run_locked([&] {
                layer_result(s, pending.layer, {false, ErrorKind::Cuda, cuda_error});
            });
        } else {
            if (const double delay = port_.post_delay_seconds(); delay > 0) {
                std::this_thread::sleep_for(std::chrono::duration<double>(delay));
            }
            // Checksums: computed by the port's copies where it can (a mapped peer's), else
            // here, off the port's lock, while the forward pass goes on.
            std::optional<std::vector<uint64_t>> sums;
            if (s->checksums() && !s->was_cancelled()) {
                bool on_copy = false;
                port_.run_locked([&] { on_copy = port_.checksums_on_copy(s->peer()); });
                if (!on_copy) {
                    sums = checksums_of(s->local_ids(), pending.layer, s->epoch());
                }
            }
            port_.run_locked([&] { post_layer(s, pending.layer, std::move(sums)); });
        }
    }
}

void StreamProtocol::post_layer(const std::shared_ptr<SaveStream>& s, int64_t layer,
                                std::optional<std::vector<uint64_t>> checksums) {
    if (s->was_cancelled()) {
        layer_result(s, layer, {false, ErrorKind::Transfer, "cancelled by the receiver"});
        return;
    }
    auto it = sending_.find({s->peer(), s->epoch()});
    if (it == sending_.end() || it->second.stream != s) {
        // It ended (failed: its peer was dropped or replaced) after this layer was saved. A
        // peer of that name now is a new connection, maybe a new run: nothing of this stream
        // may reach it, and its receiver may have been told nothing of it is in flight.
        layer_result(
            s, layer,
            {false, ErrorKind::Peer,
             describe(s->request_id(), s->peer()) + " ended before this layer was posted"});
        return;
    }
    if (!port_.peer_alive(s->peer())) {
        layer_result(s, layer, {false, ErrorKind::Peer, "peer '" + s->peer() + "' is gone"});
        return;
    }
    s->record_posted(layer);
    StreamMessage message =
        lease_message(MessageKind::Layer, s->request_id(), s->epoch(), s->ids_hash());
    message.layer = static_cast<uint32_t>(layer);
    std::shared_ptr<PutChecksums> sums;  // the port's to compute, as it copies
    if (checksums) {
        message.checksums = std::move(*checksums);
    } else if (s->checksums()) {
        sums = std::make_shared<PutChecksums>();
        for (size_t i = 0; i < s->local_ids().size(); ++i) {
            sums->seeds.push_back(checksum_seed(s->epoch(), layer, i));
        }
    }
    port_.put_then_send(
        s->peer(), s->local_ids(), s->remote_ids(), layer, s->epoch(),
        [message = std::move(message), sums]() mutable {
            if (sums) {
                message.checksums = std::move(sums->values);
            }
            return encode(message);
        },
        [this, s, layer](const PortOutcome& o) { layer_result(s, layer, o); }, sums);
}

// A layer landed (its Layer message is out) or failed; the stream may now end.
void StreamProtocol::layer_result(const std::shared_ptr<SaveStream>& s, int64_t layer,
                                  const PortOutcome& outcome) {
    if (s->layer_done(layer, outcome.ok, outcome.kind, outcome.error)) {
        ending_.push_back(s);  // sent by drain(): this may be a transport callback
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
    StreamMessage message =
        lease_message(finish ? MessageKind::Final : MessageKind::Abort, s->request_id(), s->epoch(),
                      s->ids_hash(), finish ? s->payload() : "");
    // Every posted layer's flush completed, so the message needs none of its own.
    port_.send(s->peer(), encode(message), [this, s](const PortOutcome& o) { end_sent(s, o); });
    auto it = sending_.find({s->peer(), s->epoch()});
    if (finish && it != sending_.end()) {
        it->second.deadline = steady_seconds() + config_.ack_timeout_seconds;
        sending_changed_ = true;
    }
}

void StreamProtocol::end_sent(const std::shared_ptr<SaveStream>& s, const PortOutcome& outcome) {
    if (!outcome.ok) {
        s->complete(StreamState::Failed, ErrorKind::Transfer,
                    "sending the end of " + describe(s->request_id(), s->peer()) +
                        " failed: " + outcome.error);
    } else if (s->end() == StreamEnd::Abort) {
        s->complete(StreamState::Aborted, ErrorKind::Transfer,
                    s->was_cancelled()
                        ? describe(s->request_id(), s->peer()) + " was cancelled by its receiver"
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
        sending_changed_ = true;
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
    sending_changed_ = true;
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
    sending_changed_ = true;
}

void StreamProtocol::on_ack(const std::string& sender, const StreamMessage& m) {
    auto it = sending_.find({sender, m.epoch});
    if (it == sending_.end() || it->second.stream->end() != StreamEnd::Finish) {
        ++stats_.messages_refused;
        return;
    }
    it->second.stream->complete(StreamState::Done);
    sending_.erase(it);
    sending_changed_ = true;
}

void StreamProtocol::on_cancel(const std::string& sender, const StreamMessage& m) {
    auto it = sending_.find({sender, m.epoch});
    if (it == sending_.end()) {
        // No stream of this lease here (it ended, failed, or never began): say so once
        // nothing of it is in flight.
        answer_cancel_when_quiet(sender, m);
        return;
    }
    if (it->second.stream->cancelled()) {
        ending_.push_back(it->second.stream);  // no layer in flight: the Abort is due now
    } else if (it->second.stream->was_cancelled()) {
        // Its layers not yet copied are dropped: they fail, and the Abort follows the last.
        port_.cancel_puts(sender, m.epoch);
    } else if (it->second.stream->end() == StreamEnd::Finish) {
        // The Final went out (after every put landed), yet the receiver cancels: the Final was
        // lost or crossed the Cancel. Nothing is in flight: say so, or it would cut us off.
        post_message(sender, lease_message(MessageKind::Abort, m.request_id, m.epoch, m.ids_hash));
    }
}

// A connection to the sender that was closed (we dropped or replaced it) may still have copies
// of the lease under way: the Abort waits for them (drain() sends it).
void StreamProtocol::answer_cancel_when_quiet(const std::string& sender, const StreamMessage& m) {
    StreamMessage abort = lease_message(MessageKind::Abort, m.request_id, m.epoch, m.ids_hash);
    if (port_.peer_quiet(sender)) {
        post_message(sender, std::move(abort));
    } else {
        held_aborts_.emplace_back(sender, std::move(abort));
    }
}

// ---- offers ---------------------------------------------------------------------------

std::vector<Offer> StreamProtocol::offers() {
    return offers_.take_all();
}

Offer StreamProtocol::wait_offer(double timeout_seconds) {
    check_timeout(timeout_seconds);
    std::optional<Offer> offer = offers_.take(timeout_seconds);
    KVMOVE_CHECK(offer.has_value(), Timeout,
                 "no offer for agent '" << port_.local_name() << "' within " << timeout_seconds
                                        << " s" << (closed_ ? " (agent closed)" : ""));
    return std::move(*offer);
}

void StreamProtocol::decline(const Offer& offer, const std::string& reason) {
    check_request_id(offer.request_id);
    KVMOVE_CHECK(offer.epoch != 0, Config,
                 "an offer of no blocks (" << describe(offer.request_id, offer.peer)
                                           << ") has no lease to decline");
    KVMOVE_CHECK(reason.size() <= kMaxPayloadBytes, Config,
                 "a decline's reason of " << reason.size() << " bytes exceeds the limit of "
                                          << kMaxPayloadBytes);
    port_.run_locked([&] {
        check_open();
        KVMOVE_CHECK(sending_.count({offer.peer, offer.epoch}) == 0, Config,
                     "lease " << offer.epoch << " of '" << offer.peer << "' is being streamed "
                              << "into: abort the stream instead of declining it");
        KVMOVE_CHECK(
            port_.peer_alive(offer.peer), Peer,
            "cannot decline " << describe(offer.request_id, offer.peer) << ": it is no live peer");
        port_.send(offer.peer,
                   encode(lease_message(MessageKind::Decline, offer.request_id, offer.epoch,
                                        hash_ids(offer.block_ids), reason)),
                   [](const PortOutcome&) {});
    });
}

// A peer offers a lease of its own (or, with no blocks, needs none of a request's KV). Kept
// for the user only when it can be what it says: a lease's epoch is of the peer's current run
// and its ids are the ones it hashed; the ids' range is checked when they are streamed into.
void StreamProtocol::on_offer(const std::string& sender, const StreamMessage& m) {
    const bool empty = m.block_ids.empty();
    const bool valid = empty ? m.epoch == 0 && m.ids_hash == 0
                             : m.epoch >> 32 == port_.peer_incarnation(sender) &&
                                   m.ids_hash == hash_ids(m.block_ids);
    if (!valid || !offers_.put(Offer{sender, m.request_id, m.epoch, m.block_ids})) {
        ++stats_.messages_refused;
        KVMOVE_LOG(Warning, "stream",
                   "agent '" << port_.local_name() << "' dropped an offer of "
                             << describe(m.request_id, sender) << ": "
                             << (valid ? "too many of its offers are waiting"
                                       : "its epoch or ids hash is not the peer's"));
    }
}

}  // namespace kvmove
