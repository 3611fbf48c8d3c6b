// The Agent's half of layer streaming: the protocol of csrc/layer_stream.h over UCX.
//
// Every function here runs with worker_mu_ held (the user verbs take it; UCX callbacks run
// inside ucp_worker_progress, which is only called with it held), except post_loop(), which
// takes it to post. Lock order: worker_mu_, then a stream's own mutex.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <thread>

#include "transport/agent.h"
#include "transport/agent_internal.h"
#include "cuda/cuda_event.h"

namespace kvmove {

namespace {

constexpr size_t kMaxUnclaimed = 4096;    // messages held for loads not started yet
constexpr double kUnclaimedSeconds = 60;  // and for at most this long

std::string describe(const std::string& request_id, const std::string& peer) {
    return "request '" + request_id + "' with '" + peer + "'";
}

void check_request_id(const std::string& request_id) {
    KVMOVE_CHECK(!request_id.empty() && request_id.size() <= kMaxRequestIdBytes, Config,
                 "request_id must be 1.." << kMaxRequestIdBytes << " bytes, got "
                                          << request_id.size());
}

}  // namespace

// ---- sender ---------------------------------------------------------------------------

std::shared_ptr<SaveStream> Agent::stream_to(const std::string& peer_name,
                                             const std::vector<BlockId>& local_ids,
                                             const std::vector<BlockId>& remote_ids,
                                             const std::string& request_id) {
    check_request_id(request_id);
    std::vector<int64_t> layers(static_cast<size_t>(shape_.num_layers));
    for (int64_t l = 0; l < shape_.num_layers; ++l) {
        layers[l] = l;
    }
    WorkerLock lock(*this);
    check_open();
    Peer& peer = live_peer(peer_name);
    validate(peer, Direction::Put, local_ids, remote_ids, layers, std::nullopt);
    KVMOVE_CHECK(sending_.count({peer_name, request_id}) == 0, Config,
                 describe(request_id, peer_name) << " is already being streamed");
    auto stream = std::make_shared<SaveStream>(this, peer_name, local_ids, remote_ids, request_id,
                                               shape_.num_layers, next_serial_++);
    sending_.emplace(StreamKey{peer_name, request_id}, stream);
    return stream;
}

void Agent::queue_post(std::shared_ptr<SaveStream> stream, int64_t layer, uintptr_t cuda_event) {
    {
        std::lock_guard<std::mutex> lock(post_mu_);
        KVMOVE_CHECK(!post_stop_, Config, "agent '" << name_ << "' is closed");
        to_post_.push_back(PendingLayer{std::move(stream), layer, cuda_event});
        if (!post_thread_.joinable()) {
            post_thread_ = std::thread([this] { post_loop(); });
        }
    }
    post_cv_.notify_one();
}

void Agent::post_layer(const std::shared_ptr<SaveStream>& s, int64_t layer) {
    auto it = peers_.find(s->peer_);
    if (it == peers_.end() || !it->second->failure.empty()) {
        layer_result(s, layer, UCS_ERR_CANCELED, "peer '" + s->peer_ + "' is gone");
        return;
    }
    Peer& peer = *it->second;
    std::vector<RmaOp> ops =
        plan_ops(s->local_ids_, s->remote_ids_, {layer}, local_geometry(), peer.geometry);
    auto transfer = std::make_shared<Transfer>(
        s->peer_, s->local_ids_.size() * cache_.block_nbytes(), ops.size());
    s->record_posted(layer);
    post_ops(Direction::Put, peer, ops, *transfer);
    if (transfer->state() != TransferState::Pending) {
        layer_result(s, layer, UCS_ERR_IO_ERROR, transfer->error());
        return;
    }
    StreamMessage message{MessageKind::Layer, s->request_id_, static_cast<int32_t>(layer),
                          s->ids_hash_, s->serial_, ""};
    auto entry = std::make_unique<InFlight>(this, transfer, &peer, encode(message));
    entry->am_id = kStreamAmId;
    entry->stream = s;
    entry->layer = layer;
    post_flush(track(std::move(entry)));
}

// A layer landed (its Layer message is out) or failed; the stream may now close.
void Agent::layer_result(const std::shared_ptr<SaveStream>& s, int64_t layer,
                         ucs_status_t status, const std::string& error, ErrorKind kind) {
    bool peer_gone = status == UCS_ERR_ENDPOINT_TIMEOUT || status == UCS_ERR_CONNECTION_RESET ||
                     status == UCS_ERR_UNREACHABLE || status == UCS_ERR_CANCELED;
    std::string why = error.empty() ? "UCX reported " + status_text(status) : error;
    if (s->layer_done(layer, status == UCS_OK, peer_gone ? ErrorKind::Peer : kind, why)) {
        closing_.push_back(s);  // sent by drain_deferred(): this may be a UCX callback
    }
}

void Agent::post_close(const std::shared_ptr<SaveStream>& s) {
    bool finish = s->closing() == SaveStream::Closing::Finish;
    auto it = peers_.find(s->peer_);
    if (it == peers_.end() || !it->second->failure.empty()) {
        if (finish) {
            s->complete(StreamState::Failed, ErrorKind::Peer,
                        "peer '" + s->peer_ + "' is gone before " +
                            describe(s->request_id_, s->peer_) + " was delivered");
        } else {
            s->complete(StreamState::Aborted);  // no one left to tell
        }
        forget(*s);
        return;
    }
    StreamMessage message{finish ? MessageKind::Final : MessageKind::Abort, s->request_id_, -1,
                          s->ids_hash_, s->serial_, finish ? s->payload() : ""};
    auto transfer = std::make_shared<Transfer>(s->peer_, 0, 0);
    auto entry =
        std::make_unique<InFlight>(this, transfer, it->second.get(), encode(message));
    entry->am_id = kStreamAmId;
    entry->want_reply = finish;  // the receiver acks a Final
    entry->stream = s;
    // Every layer's flush completed, so the message needs none of its own.
    send_notification(track(std::move(entry)));
}

// Drops an ended stream from sending_ (not a newer one that reuses its request id).
void Agent::forget(SaveStream& s) {
    auto it = sending_.find({s.peer_, s.request_id_});
    if (it != sending_.end() && it->second.get() == &s) {
        sending_.erase(it);
    }
}

void Agent::stream_transfer_done(InFlight* entry, ucs_status_t status) {
    SaveStream& s = *entry->stream;
    if (entry->layer >= 0) {
        layer_result(entry->stream, entry->layer, status, "");
        return;
    }
    if (status != UCS_OK) {
        s.complete(StreamState::Failed, ErrorKind::Transfer,
                   "sending the end of " + describe(s.request_id_, s.peer_) +
                       " failed: UCX reported " + status_text(status));
    } else if (s.closing() == SaveStream::Closing::Abort) {
        s.complete(StreamState::Aborted);
    } else {
        return;  // a Final: DONE when the receiver's Ack arrives
    }
    forget(s);
}

void Agent::post_loop() {
    while (true) {
        PendingLayer pending;
        {
            std::unique_lock<std::mutex> lock(post_mu_);
            post_cv_.wait(lock, [this] { return post_stop_ || !to_post_.empty(); });
            if (post_stop_) {
                return;
            }
            pending = std::move(to_post_.front());
            to_post_.pop_front();
        }
        std::string error;
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
            error = e.what();
        }
        WorkerLock lock(*this);
        if (pending.layer == kCloseLayer) {
            post_close(pending.stream);
        } else if (error.empty()) {
            post_layer(pending.stream, pending.layer);
        } else {
            layer_result(pending.stream, pending.layer, UCS_ERR_IO_ERROR, error, ErrorKind::Cuda);
        }
        drain_deferred();
        ucp_worker_signal(worker_.get());
    }
}

// ---- receiver -------------------------------------------------------------------------

std::shared_ptr<LoadStream> Agent::expect(const std::string& peer_name,
                                          const std::string& request_id,
                                          const std::vector<BlockId>& local_ids) {
    check_request_id(request_id);
    for (BlockId id : local_ids) {
        KVMOVE_CHECK(id >= 0 && id < cache_.num_blocks(), Block,
                     "local block " << id << " is out of range: ids are in [0, "
                                    << cache_.num_blocks() << ")");
    }
    std::vector<BlockId> sorted = local_ids;
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    KVMOVE_CHECK(dup == sorted.end(), Block,
                 "destination block " << (dup == sorted.end() ? 0 : *dup)
                                      << " appears twice: each may be written once per transfer");
    WorkerLock lock(*this);
    check_open();
    Peer& peer = live_peer(peer_name);
    std::string difference = shape_difference(shape_, peer.meta.shape, peer_name);
    KVMOVE_CHECK(difference.empty(), Config, "KV layouts differ: " << difference);
    return std::make_shared<LoadStream>(this, peer_name, request_id, local_ids,
                                        shape_.num_layers);
}

void Agent::start_load(LoadStream& load) {
    WorkerLock lock(*this);
    check_open();
    StreamKey key{load.peer_, load.request_id_};
    {
        std::lock_guard<std::mutex> state_lock(load.mu_);
        KVMOVE_CHECK(!load.started_ && load.state_ == StreamState::Open, Config,
                     "start_load() of " << describe(load.request_id_, load.peer_)
                                        << (load.started_ ? " was already called" : " after cancel()"));
    }
    KVMOVE_CHECK(loading_.count(key) == 0, Config,
                 describe(load.request_id_, load.peer_) << " is already being loaded");
    live_peer(load.peer_);  // a dead sender will send nothing: fail now
    {
        std::lock_guard<std::mutex> state_lock(load.mu_);
        load.started_ = true;
    }
    auto shared = load.shared_from_this();
    loading_.emplace(key, shared);
    auto dropped = dropped_.find(key);
    if (dropped != dropped_.end() && !dropped->second.bound) {
        dropped_.erase(dropped);  // the next stream is this load's, not a cancelled one's
    }
    // Messages that came first, in arrival order.
    std::vector<StreamMessage> early;
    auto from_this = [&](const Unclaimed& u) {
        return u.sender == load.peer_ && u.message.request_id == load.request_id_;
    };
    for (const Unclaimed& u : unclaimed_) {
        if (from_this(u)) {
            early.push_back(u.message);
        }
    }
    unclaimed_.erase(std::remove_if(unclaimed_.begin(), unclaimed_.end(), from_this),
                     unclaimed_.end());
    for (const StreamMessage& m : early) {
        deliver(shared, m);
    }
}

void Agent::cancel_load(LoadStream& load) {
    WorkerLock lock(*this);
    bool registered = false;
    auto it = loading_.find({load.peer_, load.request_id_});
    if (it != loading_.end() && it->second.get() == &load) {
        loading_.erase(it);
        registered = true;
    }
    if (load.complete(StreamState::Failed, ErrorKind::Transfer,
                      describe(load.request_id_, load.peer_) + " was cancelled by the receiver") &&
        registered) {
        drop_rest(load);  // its stream may still be sending: no later load may take that
    }
}

// The rest of the stream a load took (or, unbound, the next one to arrive) is dropped, until
// its Final or Abort, so that a later load of the same request id gets only a new stream.
void Agent::drop_rest(const LoadStream& load) {
    double now = steady_seconds();
    for (auto it = dropped_.begin(); it != dropped_.end();) {
        it = now - it->second.since > kUnclaimedSeconds ? dropped_.erase(it) : std::next(it);
    }
    dropped_[{load.peer_, load.request_id_}] = Dropped{now, load.bound_, load.serial_};
}

void Agent::deliver(const std::shared_ptr<LoadStream>& load, const StreamMessage& m) {
    if (!load->bound_) {
        load->bound_ = true;
        load->serial_ = m.serial;
    } else if (m.serial != load->serial_) {
        return;  // an older stream's straggler, or a newer stream than this load's
    }
    bool ended = false;
    if (m.ids_hash != load->ids_hash_) {
        ended = load->complete(StreamState::Failed, ErrorKind::Transfer,
                               "sender '" + load->peer_ + "' streamed request '" +
                                   load->request_id_ +
                                   "' into other blocks than this load expects (ids hash differs)");
        if (ended && m.kind == MessageKind::Layer) {
            drop_rest(*load);
        }
    } else if (m.kind == MessageKind::Abort) {
        ended = load->complete(StreamState::Aborted);
    } else if (m.kind == MessageKind::Layer && (m.layer < 0 || m.layer >= load->num_layers_)) {
        ended = load->complete(StreamState::Failed, ErrorKind::Transfer,
                               "sender '" + load->peer_ + "' sent layer " +
                                   std::to_string(m.layer) + " of request '" + load->request_id_ +
                                   "', layers are in [0, " + std::to_string(load->num_layers_) +
                                   ")");
    } else {
        ended = load->apply(m.layer, m.kind == MessageKind::Final, m.payload);
    }
    if (ended || load->state() != StreamState::Open) {
        auto it = loading_.find({load->peer_, load->request_id_});
        if (it != loading_.end() && it->second == load) {
            loading_.erase(it);
        }
    }
}

ucs_status_t Agent::on_stream_am(void* arg, const void* header, size_t header_nbytes, void* data,
                                 size_t nbytes, const ucp_am_recv_param_t* param) {
    auto agent = static_cast<Agent*>(arg);
    std::string sender(static_cast<const char*>(header), header_nbytes);
    ucp_ep_h reply_ep =
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
    try {
        agent->on_stream_message(sender, decode_stream_message(data, nbytes), reply_ep);
    } catch (const Error& e) {
        // Nobody to raise to inside UCX's callback: a malformed message is dropped, loudly.
        std::fprintf(stderr, "kvmove: agent '%s' dropped a stream message from '%s': %s\n",
                     agent->name_.c_str(), sender.c_str(), e.what());
    }
    return UCS_OK;  // the data was copied; UCX may release it
}

void Agent::on_stream_message(const std::string& sender, const StreamMessage& m,
                              ucp_ep_h reply_ep) {
    if (m.kind == MessageKind::Ack) {
        auto it = sending_.find({sender, m.request_id});
        if (it != sending_.end() && it->second->serial_ == m.serial) {
            it->second->complete(StreamState::Done);
            sending_.erase(it);
        }
        return;
    }
    if (m.kind == MessageKind::Final && reply_ep != nullptr) {
        send_ack(reply_ep, m);  // the bytes and the Final are here, whether claimed or not
    }
    StreamKey key{sender, m.request_id};
    auto dropped = dropped_.find(key);
    if (dropped != dropped_.end()) {
        Dropped& d = dropped->second;
        if (!d.bound) {
            d.bound = true;
            d.serial = m.serial;
        }
        if (d.serial == m.serial) {
            if (m.kind != MessageKind::Layer) {
                dropped_.erase(dropped);  // that stream ended: the next one is wanted again
            }
            return;
        }
        dropped_.erase(dropped);  // a newer stream
    }
    auto it = loading_.find(key);
    if (it != loading_.end()) {
        deliver(it->second, m);
        return;
    }
    // Kept for a start_load() to come; a newer stream of the request replaces an older one.
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

namespace {

void free_ack(void* request, ucs_status_t, void* user_data) {
    delete static_cast<std::string*>(user_data);
    ucp_request_free(request);
}

}  // namespace

void Agent::send_ack(ucp_ep_h reply_ep, const StreamMessage& final) {
    auto data = new std::string(encode(StreamMessage{MessageKind::Ack, final.request_id, -1,
                                                     final.ids_hash, final.serial, ""}));
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &free_ack;
    param.user_data = data;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t request = ucp_am_send_nbx(reply_ep, kStreamAmId, name_.data(), name_.size(),
                                               data->data(), data->size(), &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) {
        delete data;  // sent at once, or not at all: the sender's wait then fails or times out
    }
}

// ---- both -----------------------------------------------------------------------------

void Agent::end_peer_streams(const std::string& peer, ErrorKind kind, const std::string& reason) {
    for (auto it = sending_.begin(); it != sending_.end();) {
        if (it->first.first == peer) {
            it->second->complete(StreamState::Failed, kind,
                                 "stream of " + describe(it->first.second, peer) + " failed: " +
                                     reason);
            it = sending_.erase(it);
        } else {
            ++it;
        }
    }
    for (auto it = loading_.begin(); it != loading_.end();) {
        if (it->first.first == peer) {
            it->second->complete(StreamState::Failed, kind,
                                 "load of " + describe(it->first.second, peer) + " failed: " +
                                     reason);
            it = loading_.erase(it);
        } else {
            ++it;
        }
    }
}

void Agent::end_all_streams(const std::string& reason) {
    for (auto& [key, stream] : sending_) {
        stream->complete(StreamState::Failed, ErrorKind::Transfer,
                         "stream of " + describe(key.second, key.first) + " failed: " + reason);
    }
    for (auto& [key, load] : loading_) {
        load->complete(StreamState::Failed, ErrorKind::Transfer,
                       "load of " + describe(key.second, key.first) + " failed: " + reason);
    }
    sending_.clear();
    loading_.clear();
    closing_.clear();
    unclaimed_.clear();
    dropped_.clear();
}

}  // namespace kvmove
