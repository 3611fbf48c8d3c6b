#include "stream/stream_protocol.h"

#include <algorithm>
#include <cstdio>
#include <random>

#include "cuda/cuda_event.h"

namespace kvmove {

namespace {

constexpr size_t kMaxUnclaimed = 4096;    // messages held for loads not started yet
constexpr double kUnclaimedSeconds = 60;  // and for at most this long

std::string describe(const std::string& request_id, const std::string& peer) {
    return "request '" + request_id + "' with '" + peer + "'";
}

void check_request_id(const std::string& request_id) {
    KVMOVE_CHECK(
        !request_id.empty() && request_id.size() <= kMaxRequestIdBytes, Config,
        "request_id must be 1.." << kMaxRequestIdBytes << " bytes, got " << request_id.size());
}

uint64_t random_serial() {
    std::random_device entropy;  // stream serials start at random: a restarted sender differs
    return (uint64_t{entropy()} << 32) ^ entropy();
}

}  // namespace

StreamProtocol::StreamProtocol(StreamPort& port, const KVGeometry& local)
    : port_(port), local_(local), next_serial_(random_serial()) {}

StreamProtocol::~StreamProtocol() {
    stop_posting();
}

void StreamProtocol::check_open() const {
    KVMOVE_CHECK(!closed_, Config, "agent '" << port_.local_name() << "' is closed");
}

// ---- sender ---------------------------------------------------------------------------

std::shared_ptr<SaveStream> StreamProtocol::stream_to(const std::string& peer,
                                                      const std::vector<BlockId>& local_ids,
                                                      const std::vector<BlockId>& remote_ids,
                                                      const std::string& request_id) {
    check_request_id(request_id);
    std::shared_ptr<SaveStream> stream;
    port_.run_locked([&] {
        check_open();
        port_.check_put(peer, local_ids, remote_ids);
        KVMOVE_CHECK(sending_.count({peer, request_id}) == 0, Config,
                     describe(request_id, peer) << " is already being streamed");
        stream = std::make_shared<SaveStream>(this, peer, local_ids, remote_ids, request_id,
                                              local_.num_layers(), next_serial_++);
        sending_.emplace(StreamKey{peer, request_id}, stream);
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
    {
        std::lock_guard<std::mutex> lock(post_mu_);
        KVMOVE_CHECK(!post_stop_, Config, "agent '" << port_.local_name() << "' is closed");
        to_post_.push_back(std::move(pending));
        if (!post_thread_.joinable()) {
            post_thread_ = std::thread([this] { post_loop(); });
        }
    }
    post_cv_.notify_one();
}

void StreamProtocol::post_loop() {
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
        port_.run_locked([&] { post(pending, cuda_error); });
    }
}

void StreamProtocol::post(const Pending& pending, const std::string& cuda_error) {
    if (pending.kind == Pending::Kind::End) {
        send_end(pending.stream);
    } else if (cuda_error.empty()) {
        post_layer(pending.stream, pending.layer);
    } else {
        layer_result(pending.stream, pending.layer, {false, ErrorKind::Cuda, cuda_error});
    }
}

void StreamProtocol::post_layer(const std::shared_ptr<SaveStream>& s, int64_t layer) {
    if (!port_.peer_alive(s->peer())) {
        layer_result(s, layer, {false, ErrorKind::Peer, "peer '" + s->peer() + "' is gone"});
        return;
    }
    s->record_posted(layer);
    StreamMessage message{MessageKind::Layer, s->request_id(), static_cast<int32_t>(layer),
                          s->ids_hash(),      s->serial(),     ""};
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
                          -1,
                          s->ids_hash(),
                          s->serial(),
                          finish ? s->payload() : ""};
    // Every layer's flush completed, so the message needs none of its own; the receiver acks a
    // Final.
    port_.send(s->peer(), encode(message), finish,
               [this, s](const PortOutcome& o) { end_sent(s, o); });
}

void StreamProtocol::end_sent(const std::shared_ptr<SaveStream>& s, const PortOutcome& outcome) {
    if (!outcome.ok) {
        s->complete(StreamState::Failed, ErrorKind::Transfer,
                    "sending the end of " + describe(s->request_id(), s->peer()) +
                        " failed: " + outcome.error);
    } else if (s->end() == StreamEnd::Abort) {
        s->complete(StreamState::Aborted);
    } else {
        return;  // a Final: DONE when the receiver's Ack arrives
    }
    forget(*s);
}

// Drops an ended stream from sending_ (not a newer one that reuses its request id).
void StreamProtocol::forget(const SaveStream& s) {
    auto it = sending_.find({s.peer(), s.request_id()});
    if (it != sending_.end() && it->second.get() == &s) {
        sending_.erase(it);
    }
}

// ---- receiver -------------------------------------------------------------------------

std::shared_ptr<LoadStream> StreamProtocol::expect(const std::string& peer,
                                                   const std::string& request_id,
                                                   const std::vector<BlockId>& local_ids) {
    check_request_id(request_id);
    local_.check_ids(local_ids, "local");
    std::vector<BlockId> sorted = local_ids;
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    KVMOVE_CHECK(dup == sorted.end(), Block,
                 "destination block " << (dup == sorted.end() ? 0 : *dup)
                                      << " appears twice: each may be written once per transfer");
    port_.run_locked([&] {
        check_open();
        port_.check_sender(peer);
    });
    return std::make_shared<LoadStream>(this, peer, request_id, local_ids, local_.num_layers());
}

void StreamProtocol::start_load(LoadStream& load) {
    port_.run_locked([&] {
        check_open();
        load.check_startable();
        const StreamKey key{load.peer(), load.request_id()};
        KVMOVE_CHECK(loading_.count(key) == 0, Config,
                     describe(load.request_id(), load.peer()) << " is already being loaded");
        port_.check_sender(load.peer());  // a dead sender will send nothing: fail now
        load.mark_started();
        loading_.emplace(key, Loading{load.shared_from_this()});
        auto dropped = dropped_.find(key);
        if (dropped != dropped_.end() && !dropped->second.bound) {
            dropped_.erase(dropped);  // the next stream is this load's, not a cancelled one's
        }
        // Messages that came first, in arrival order.
        std::vector<StreamMessage> early;
        auto from_this = [&](const Unclaimed& u) {
            return u.sender == key.first && u.message.request_id == key.second;
        };
        for (const Unclaimed& u : unclaimed_) {
            if (from_this(u)) {
                early.push_back(u.message);
            }
        }
        unclaimed_.erase(std::remove_if(unclaimed_.begin(), unclaimed_.end(), from_this),
                         unclaimed_.end());
        for (const StreamMessage& m : early) {
            auto it = loading_.find(key);
            if (it == loading_.end()) {
                break;  // the load ended: the rest is of no use to it
            }
            deliver(it->second, m);
        }
    });
}

void StreamProtocol::cancel_load(LoadStream& load) {
    port_.run_locked([&] {
        bool registered = false;
        Loading entry;
        auto it = loading_.find({load.peer(), load.request_id()});
        if (it != loading_.end() && it->second.load.get() == &load) {
            entry = std::move(it->second);
            loading_.erase(it);
            registered = true;
        }
        if (load.complete(
                StreamState::Failed, ErrorKind::Transfer,
                describe(load.request_id(), load.peer()) + " was cancelled by the receiver") &&
            registered) {
            // Its stream may still be sending: no later load may take that.
            drop_rest(load, entry.bound, entry.serial);
        }
    });
}

// The rest of the stream a load took (or, unbound, the next one to arrive) is dropped, until
// its Final or Abort, so that a later load of the same request id gets only a new stream.
void StreamProtocol::drop_rest(const LoadStream& load, bool bound, uint64_t serial) {
    double now = steady_seconds();
    for (auto it = dropped_.begin(); it != dropped_.end();) {
        it = now - it->second.since > kUnclaimedSeconds ? dropped_.erase(it) : std::next(it);
    }
    dropped_[{load.peer(), load.request_id()}] = Dropped{now, bound, serial};
}

void StreamProtocol::unregister(const LoadStream& load) {
    auto it = loading_.find({load.peer(), load.request_id()});
    if (it != loading_.end() && it->second.load.get() == &load) {
        loading_.erase(it);
    }
}

void StreamProtocol::deliver(Loading& entry, const StreamMessage& m) {
    const std::shared_ptr<LoadStream> load = entry.load;  // entry may go in unregister()
    if (!entry.bound) {
        entry.bound = true;
        entry.serial = m.serial;
    } else if (m.serial != entry.serial) {
        return;  // an older stream's straggler, or a newer stream than this load's
    }
    bool ended = false;
    if (m.ids_hash != load->ids_hash()) {
        ended =
            load->complete(StreamState::Failed, ErrorKind::Transfer,
                           "sender '" + load->peer() + "' streamed request '" + load->request_id() +
                               "' into other blocks than this load expects (ids hash differs)");
        if (ended && m.kind == MessageKind::Layer) {
            drop_rest(*load, entry.bound, entry.serial);
        }
    } else if (m.kind == MessageKind::Abort) {
        ended = load->complete(StreamState::Aborted);
    } else if (m.kind == MessageKind::Layer && (m.layer < 0 || m.layer >= load->num_layers())) {
        ended =
            load->complete(StreamState::Failed, ErrorKind::Transfer,
                           "sender '" + load->peer() + "' sent layer " + std::to_string(m.layer) +
                               " of request '" + load->request_id() + "', layers are in [0, " +
                               std::to_string(load->num_layers()) + ")");
    } else {
        ended = load->apply(m.layer, m.kind == MessageKind::Final, m.payload);
    }
    if (ended || load->state() != StreamState::Open) {
        unregister(*load);
    }
}

void StreamProtocol::on_message(const std::string& sender, const void* data, size_t nbytes,
                                ReplyHandle reply_to) {
    StreamMessage m;
    try {
        m = decode_stream_message(data, nbytes);
    } catch (const Error& e) {
        // Nobody to raise to inside the transport's callback: a malformed message is dropped,
        // loudly.
        std::fprintf(stderr, "kvmove: agent '%s' dropped a stream message from '%s': %s\n",
                     port_.local_name().c_str(), sender.c_str(), e.what());
        return;
    }
    if (m.kind == MessageKind::Ack) {
        on_ack(sender, m);
        return;
    }
    if (m.kind == MessageKind::Final && reply_to != nullptr) {
        // The bytes and the Final are here, whether claimed or not.
        port_.reply(reply_to, encode(StreamMessage{MessageKind::Ack, m.request_id, -1, m.ids_hash,
                                                   m.serial, ""}));
    }
    const StreamKey key{sender, m.request_id};
    if (drop_if_cancelled(key, m)) {
        return;
    }
    auto it = loading_.find(key);
    if (it != loading_.end()) {
        deliver(it->second, m);
        return;
    }
    keep_unclaimed(sender, m);
}

void StreamProtocol::on_ack(const std::string& sender, const StreamMessage& m) {
    auto it = sending_.find({sender, m.request_id});
    if (it != sending_.end() && it->second->serial() == m.serial) {
        it->second->complete(StreamState::Done);
        sending_.erase(it);
    }
}

// True when m belongs to the rest of a cancelled load's stream.
bool StreamProtocol::drop_if_cancelled(const StreamKey& key, const StreamMessage& m) {
    auto dropped = dropped_.find(key);
    if (dropped == dropped_.end()) {
        return false;
    }
    Dropped& d = dropped->second;
    if (!d.bound) {
        d.bound = true;
        d.serial = m.serial;
    }
    if (d.serial == m.serial) {
        if (m.kind != MessageKind::Layer) {
            dropped_.erase(dropped);  // that stream ended: the next one is wanted again
        }
        return true;
    }
    dropped_.erase(dropped);  // a newer stream
    return false;
}

// Kept for a start_load() to come; a newer stream of the request replaces an older one.
void StreamProtocol::keep_unclaimed(const std::string& sender, const StreamMessage& m) {
    double now = steady_seconds();
    unclaimed_.erase(std::remove_if(unclaimed_.begin(), unclaimed_.end(),
                                    [&](const Unclaimed& u) {
                                        return u.sender == sender &&
                                               u.message.request_id == m.request_id &&
                                               u.message.serial != m.serial;
                                    }),
                     unclaimed_.end());
    while (!unclaimed_.empty() && (unclaimed_.size() >= kMaxUnclaimed ||
                                   now - unclaimed_.front().arrived > kUnclaimedSeconds)) {
        unclaimed_.pop_front();
    }
    unclaimed_.push_back(Unclaimed{now, sender, m});
}

// ---- both -----------------------------------------------------------------------------

void StreamProtocol::peer_failed(const std::string& peer, ErrorKind kind,
                                 const std::string& reason) {
    for (auto it = sending_.begin(); it != sending_.end();) {
        if (it->first.first == peer) {
            it->second->complete(
                StreamState::Failed, kind,
                "stream of " + describe(it->first.second, peer) + " failed: " + reason);
            it = sending_.erase(it);
        } else {
            ++it;
        }
    }
    for (auto it = loading_.begin(); it != loading_.end();) {
        if (it->first.first == peer) {
            it->second.load->complete(
                StreamState::Failed, kind,
                "load of " + describe(it->first.second, peer) + " failed: " + reason);
            it = loading_.erase(it);
        } else {
            ++it;
        }
    }
}

void StreamProtocol::stop_posting() {
    closed_ = true;
    {
        std::lock_guard<std::mutex> lock(post_mu_);
        post_stop_ = true;
    }
    post_cv_.notify_all();
    if (post_thread_.joinable()) {
        post_thread_.join();
    }
}

void StreamProtocol::close(const std::string& reason) {
    closed_ = true;
    for (auto& [key, stream] : sending_) {
        stream->complete(StreamState::Failed, ErrorKind::Transfer,
                         "stream of " + describe(key.second, key.first) + " failed: " + reason);
    }
    for (auto& [key, entry] : loading_) {
        entry.load->complete(StreamState::Failed, ErrorKind::Transfer,
                             "load of " + describe(key.second, key.first) + " failed: " + reason);
    }
    sending_.clear();
    loading_.clear();
    ending_.clear();
    unclaimed_.clear();
    dropped_.clear();
}

}  // namespace kvmove
