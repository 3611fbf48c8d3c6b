#include "transport/agent.h"

#include <poll.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>

#include "common/log.h"
#include "transport/agent_internal.h"

namespace kvmove {

namespace {

// How a UCX status ends a transfer: a peer that went away is a PeerError, anything else a
// TransferError.
PortOutcome outcome_of(ucs_status_t status) {
    if (status == UCS_OK) {
        return {};
    }
    bool peer_gone = status == UCS_ERR_ENDPOINT_TIMEOUT || status == UCS_ERR_CONNECTION_RESET ||
                     status == UCS_ERR_UNREACHABLE || status == UCS_ERR_CANCELED;
    return {false, peer_gone ? ErrorKind::Peer : ErrorKind::Transfer,
            "UCX reported " + status_text(status)};
}

constexpr int kIdleSpins = 2000;       // progress calls with nothing done before sleeping
constexpr int kSleepMs = 100;          // longest sleep; stop_ is checked at least this often
constexpr double kTickSeconds = 1e-3;  // how often the streams' deadlines are checked
// How often the progress thread polls mapped peers' pidfds (one poll() each; a transfer
// checks them too, before it posts).
constexpr double kCheckPeersSeconds = 10e-3;
constexpr double kCloseSeconds = 2.0;  // how long close() lets pending work finish
// How long wait_notification() polls the worker from the waiting thread before it sleeps.
constexpr double kPollNotifySeconds = 200e-6;

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// An agent's incarnation (transport/metadata.h): random, nonzero.
uint32_t random_incarnation() {
    std::random_device entropy;
    uint32_t value = 0;
    while (value == 0) {
        value = entropy();
    }
    return value;
}

// What a peer needs to map segment i of the cache (transport/peer_mapping.h): kvmove's own
// region is a memfd; a wrapped engine tensor or device memory is not, and keeps UCX.
void describe_memfd(const KVCache& cache, size_t i, RemoteSegment& segment) {
    struct stat st {};
    if (i != 0 || cache.wrapped() || cache.on_device() || cache.region().memfd() < 0 ||
        fstat(cache.region().memfd(), &st) != 0) {
        return;
    }
    segment.memfd = cache.region().memfd();
    segment.memfd_dev = static_cast<uint64_t>(st.st_dev);
    segment.memfd_ino = static_cast<uint64_t>(st.st_ino);
}

std::unique_ptr<FaultInjector> make_injector(const std::string& spec) {
    FaultConfig config = parse_faults(spec);
    return config.any() ? std::make_unique<FaultInjector>(config) : nullptr;
}

}  // namespace

Agent::Agent(std::string name, KVCache& cache, BlockShape shape, AgentConfig config)
    : name_(std::move(name)),
      cache_(cache),
      shape_(std::move(shape)),
      config_(std::move(config)),
      incarnation_(random_incarnation()),
      faults_(make_injector(config_.faults)),
      streams_(*this, cache.geometry(), incarnation_, config_.streams) {
    KVMOVE_CHECK(!name_.empty() && name_.size() <= kMaxAgentNameBytes, Config,
                 "agent name must be 1.." << kMaxAgentNameBytes << " bytes, got " << name_.size());
    size_t bad = first_unprintable(name_);
    KVMOVE_CHECK(bad == std::string::npos, Config,
                 "agent name must be printable ASCII (peers reject anything else), '"
                     << name_ << "' has byte "
                     << int(static_cast<unsigned char>(name_[bad == std::string::npos ? 0 : bad])));
    KVMOVE_CHECK(shape_.nbytes() == cache.block_nbytes(), Config,
                 "a block of this shape is " << shape_.nbytes() << " B per layer, the cache's "
                                             << cache.block_nbytes());
    for (auto [what, value] : {std::pair{"peer_timeout", config_.peer_timeout_seconds},
                               std::pair{"cancel_timeout", config_.streams.cancel_timeout_seconds},
                               std::pair{"ack_timeout", config_.streams.ack_timeout_seconds}}) {
        KVMOVE_CHECK(std::isfinite(value) && value > 0 && value <= kMaxTimeoutSeconds, Config,
                     what << " must be in (0, " << kMaxTimeoutSeconds << "] s, got " << value);
    }
    KVMOVE_CHECK(config_.max_peers >= 1, Config,
                 "max_peers must be at least 1, got " << config_.max_peers);
    KVMOVE_CHECK(config_.copy_threads >= 0 && config_.copy_threads <= kMaxCopyThreads, Config,
                 "copy_threads must be in [0, " << kMaxCopyThreads << "], got "
                                                << config_.copy_threads);
    context_ = make_context(config_.transports, config_.peer_timeout_seconds, config_.net_devices,
                            config_.peer_errors);
    worker_ = make_worker(context_.get());
    // One registration per segment (the region, or each wrapped tensor), never per block.
    for (const Descriptor& segment : cache.segments()) {
        registrations_.push_back(std::make_unique<MemoryRegistration>(
            context_.get(), reinterpret_cast<void*>(segment.addr), segment.nbytes,
            cache.on_device()));
    }
    KVMOVE_UCX_CHECK(ucp_worker_get_efd(worker_.get(), &event_fd_), "cannot get the worker's fd");
    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = kNotifyAmId;
    am.cb = &Agent::on_notification;
    am.arg = this;
    KVMOVE_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_.get(), &am),
                     "cannot install the notification handler");
    am.id = kStreamAmId;
    am.cb = &Agent::on_stream_am;
    KVMOVE_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_.get(), &am),
                     "cannot install the layer stream handler");
    const auto started = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::system_clock::now().time_since_epoch());
    AgentMetadata meta;
    meta.name = name_;
    meta.incarnation = incarnation_;
    meta.started_ns = static_cast<uint64_t>(started.count());
    meta.worker_address = worker_address(worker_.get());
    meta.host = this_host();
    for (size_t i = 0; i < cache.segments().size(); ++i) {
        const Descriptor& segment = cache.segments()[i];
        meta.segments.push_back({segment.addr, segment.nbytes, registrations_[i]->packed_rkey()});
        if (config_.map_same_host) {
            describe_memfd(cache, i, meta.segments.back());
        }
    }
    meta.num_layers = cache.num_layers();
    meta.num_blocks = cache.num_blocks();
    meta.num_parts = cache.geometry().num_parts();
    meta.planes = cache.geometry().planes();
    meta.shape = shape_;
    metadata_ = encode(meta);
    progress_thread_ = std::thread([this] { progress_loop(); });
}

Agent::~Agent() {
    close();
}

void Agent::close() {
    if (closed_.exchange(true)) {
        return;
    }
    streams_.stop_threads();
    stop_ = true;
    ucp_worker_signal(worker_.get());
    progress_thread_.join();
    notify_cv_.notify_all();  // wake wait_notification() callers: nothing more will come
    WorkerLock lock(*this);
    // Let transfers already posted finish (bounded), then fail what is left. Endpoints to
    // live peers close gracefully: a peer whose emulated puts (tcp) are still unacknowledged
    // when our connection vanishes can abort inside UCX 1.22 (its sw-RMA ack path treats the
    // error as fatal), so we never leave one behind when we can help it.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kCloseSeconds);
    while (!in_flight_.empty() && std::chrono::steady_clock::now() < deadline) {
        ucp_worker_progress(worker_.get());
        drain_deferred();
    }
    copier_.reset();  // cancels the copies left and joins its threads
    for (auto& [t, entry] : in_flight_) {
        t->fail(ErrorKind::Transfer, "agent '" + name_ + "' closed");
    }
    by_ep_.clear();
    for (auto& [name, peer] : peers_) {
        double left =
            std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
        peer->rkeys.clear();
        peer->endpoint->close(!peer->failure.empty(), std::max(left, 0.05));
        detach_transfers(peer.get());
    }
    // Only now, with every connection closed, are the leases released.
    streams_.close("agent '" + name_ + "' closed");
    peers_.clear();
    worker_.reset();  // may still complete requests: their callbacks need in_flight_ entries
    in_flight_.clear();
    flushed_.clear();
    copying_.clear();
    delayed_.clear();
    registrations_.clear();
    context_.reset();
}

void Agent::check_open() const {
    KVMOVE_CHECK(!closed_, Config, "agent '" << name_ << "' is closed");
}

std::string Agent::add_peer(const std::vector<uint8_t>& metadata, bool rejoin) {
    AgentMetadata meta = decode(metadata);
    WorkerLock lock(*this);
    check_open();
    auto old = peers_.find(meta.name);
    if (old != peers_.end()) {
        const AgentMetadata& known = old->second->meta;
        const bool same =
            known.incarnation == meta.incarnation && known.worker_address == meta.worker_address;
        if (same && rejoin && old->second->failure.empty()) {
            return meta.name;
        }
        KVMOVE_CHECK(!old->second->failure.empty() || !same, Peer,
                     "peer '" << meta.name << "' is already added to agent '" << name_ << "'");
        // An earlier run's metadata (a replay, or a stale copy) never displaces a later one.
        KVMOVE_CHECK(same || meta.started_ns > known.started_ns, Peer,
                     "metadata of '" << meta.name << "' is of a run that started before the one "
                                     << "agent '" << name_ << "' knows (incarnation "
                                     << meta.incarnation << " vs " << known.incarnation << ")");
        // It came back (a new incarnation), or reconnects after we cut it off: its old
        // connection goes first, and everything of the old one fails.
        drop_peer(old, true, ErrorKind::Peer,
                  "peer '" + meta.name + "' restarted (incarnation " +
                      std::to_string(known.incarnation) + " -> " +
                      std::to_string(meta.incarnation) + ")");
    }
    KVMOVE_CHECK(static_cast<int64_t>(peers_.size()) < config_.max_peers, Peer,
                 "agent '" << name_ << "' has " << peers_.size() << " peers, its limit "
                           << "(max_peers): cannot add '" << meta.name << "'");
    auto peer = std::make_unique<Peer>(this, meta);
    try {
        peer->endpoint =
            std::make_unique<Endpoint>(worker_.get(), meta.worker_address, config_.peer_errors,
                                       &Agent::on_peer_error, peer.get());
    } catch (const Error& e) {
        KVMOVE_FAIL(Peer, "cannot reach peer '" << meta.name << "': " << e.what());
    }
    try {
        for (const RemoteSegment& segment : peer->meta.segments) {
            peer->rkeys.push_back(peer->endpoint->unpack_rkey(segment.packed_rkey));
        }
    } catch (const Error& e) {
        KVMOVE_FAIL(Metadata, "bad agent metadata from '" << meta.name << "': " << e.what());
    }
    map_peer(*peer);
    std::string peer_name = peer->meta.name;
    by_ep_[peer->endpoint->get()] = peer.get();
    peers_.emplace(peer_name, std::move(peer));
    return peer_name;
}

void Agent::remove_peer(const std::string& name) {
    WorkerLock lock(*this);
    check_open();
    auto it = peers_.find(name);
    KVMOVE_CHECK(it != peers_.end(), Peer,
                 "unknown peer '" << name << "' for agent '" << name_ << "'");
    drop_peer(it, !it->second->failure.empty(), ErrorKind::Peer, "peer '" + name + "' was removed");
}

// Fails the peer's transfers, closes its endpoint (force: cancel what is posted; else flush it
// first), then ends its streams and releases its leases (the connection is gone), and forgets
// it. The key goes before its endpoint: no use of a gone peer's remote key.
void Agent::drop_peer(std::map<std::string, std::unique_ptr<Peer>>::iterator it, bool force,
                      ErrorKind kind, const std::string& reason) {
    const std::string name = it->first;
    Peer& peer = *it->second;
    by_ep_.erase(peer.endpoint->get());
    fail_peer_transfers(&peer, reason);
    peer.rkeys.clear();
    peer.endpoint->close(force, kCloseSeconds);
    detach_transfers(&peer);
    for (InFlight* entry : peer.notify_order) {
        // Flushed and waiting behind an earlier one: nothing will send it now (those still
        // in flushed_ are cancelled by drain_deferred(), their peer being null).
        if (entry->flushed &&
            std::find(flushed_.begin(), flushed_.end(), entry) == flushed_.end()) {
            finish(entry, UCS_ERR_CANCELED);
        }
    }
    streams_.peer_failed(name, kind, reason);
    peers_.erase(it);
}

std::vector<std::string> Agent::peers() const {
    WorkerLock lock(*this);
    std::vector<std::string> out;
    for (const auto& [name, peer] : peers_) {
        out.push_back(name);
    }
    return out;
}

std::vector<std::pair<std::string, std::string>> Agent::peer_transports(
    const std::string& name) const {
    WorkerLock lock(*this);
    check_open();
    return live_peer(name).endpoint->transports();
}

std::shared_ptr<Transfer> Agent::write(const std::string& peer,
                                       const std::vector<BlockId>& local_ids,
                                       const std::vector<BlockId>& remote_ids,
                                       const std::optional<std::vector<int64_t>>& layers,
                                       const std::optional<std::string>& notify) {
    return start(Direction::Put, peer, local_ids, remote_ids, layers, notify);
}

std::shared_ptr<Transfer> Agent::read(const std::string& peer,
                                      const std::vector<BlockId>& local_ids,
                                      const std::vector<BlockId>& remote_ids,
                                      const std::optional<std::vector<int64_t>>& layers,
                                      const std::optional<std::string>& notify) {
    return start(Direction::Get, peer, local_ids, remote_ids, layers, notify);
}

std::shared_ptr<Transfer> Agent::notify(const std::string& peer_name, const std::string& payload) {
    KVMOVE_CHECK(payload.size() <= kMaxNotifyBytes, Config,
                 "notification of " << payload.size() << " bytes exceeds the limit of "
                                    << kMaxNotifyBytes);
    WorkerLock lock(*this);
    check_open();
    check_mapped_peers();
    Peer& peer = live_peer(peer_name);
    auto transfer = std::make_shared<Transfer>(peer_name, 0, 0);
    auto entry = std::make_unique<InFlight>(this, transfer, &peer, payload);
    entry->flushed = true;  // nothing to flush, but it keeps its place behind earlier ones
    track(std::move(entry));
    transfer->posted(0);
    release_notifications(peer);
    ucp_worker_signal(worker_.get());
    return transfer;
}

void Agent::send_raw_stream_message(const std::string& peer, std::string message) {
    run_locked([&] {
        live_peer(peer);
        send(peer, std::move(message), [](const PortOutcome&) {});
    });
}

std::shared_ptr<Transfer> Agent::start(Direction direction, const std::string& peer_name,
                                       const std::vector<BlockId>& local_ids,
                                       const std::vector<BlockId>& remote_ids,
                                       const std::optional<std::vector<int64_t>>& layers,
                                       const std::optional<std::string>& notify) {
    std::vector<int64_t> all_layers;
    for (int64_t l = 0; !layers && l < cache_.num_layers(); ++l) {
        all_layers.push_back(l);
    }
    const std::vector<int64_t>& wanted = layers ? *layers : all_layers;
    WorkerLock lock(*this);
    check_open();  // under the lock: close() tears the worker down holding it
    check_mapped_peers();
    Peer& peer = live_peer(peer_name);
    validate(peer, direction, local_ids, remote_ids, wanted, notify);
    auto t0 = std::chrono::steady_clock::now();
    std::vector<RangePair> ranges =
        pair_ranges(cache_.geometry(), local_ids, peer.geometry, remote_ids, wanted);
    auto transfer = std::make_shared<Transfer>(
        peer_name, local_ids.size() * wanted.size() * cache_.block_nbytes(), ranges.size());
    if (peer.mapping) {
        post_copies(direction, peer, ranges,
                    std::make_unique<InFlight>(this, transfer, &peer, notify));
    } else {
        post_ranges(direction, peer, ranges, *transfer);
        if (transfer->state() == TransferState::Pending) {
            post_flush(track(std::make_unique<InFlight>(this, transfer, &peer, notify)));
        }
    }
    transfer->posted(seconds_since(t0));
    if (peer.mapping) {
        drain_deferred();  // an inline copy is done: its notification goes now
    }
    ucp_worker_signal(worker_.get());  // wake the progress thread if it sleeps
    return transfer;
}

Agent::Peer& Agent::live_peer(const std::string& name) const {
    auto it = peers_.find(name);
    KVMOVE_CHECK(it != peers_.end(), Peer,
                 "unknown peer '" << name << "' for agent '" << name_ << "'");
    KVMOVE_CHECK(it->second->failure.empty(), Peer,
                 "peer '" << name << "' failed: " << it->second->failure);
    return *it->second;
}

void Agent::validate(const Peer& peer, Direction direction, const std::vector<BlockId>& local_ids,
                     const std::vector<BlockId>& remote_ids, const std::vector<int64_t>& layers,
                     const std::optional<std::string>& notify) const {
    const std::string& name = peer.meta.name;
    std::string difference =
        shape_difference(cache_.num_layers(), shape_, peer.meta.num_layers, peer.meta.shape, name);
    KVMOVE_CHECK(difference.empty(), Config, "KV layouts differ: " << difference);
    KVMOVE_CHECK(local_ids.size() == remote_ids.size(), Config,
                 "cannot pair " << local_ids.size() << " local blocks with " << remote_ids.size()
                                << " remote blocks of '" << name << "'");
    for (BlockId id : local_ids) {
        KVMOVE_CHECK(id >= 0 && id < cache_.num_blocks(), Block,
                     "local block " << id << " is out of range: ids are in [0, "
                                    << cache_.num_blocks() << ")");
    }
    for (BlockId id : remote_ids) {
        KVMOVE_CHECK(id >= 0 && id < peer.meta.num_blocks, Block,
                     "block " << id << " of '" << name << "' is out of range: ids are in [0, "
                              << peer.meta.num_blocks << ")");
    }
    // Two copies into one destination block would race; reject them.
    std::vector<BlockId> targets = direction == Direction::Put ? remote_ids : local_ids;
    std::sort(targets.begin(), targets.end());
    auto dup = std::adjacent_find(targets.begin(), targets.end());
    KVMOVE_CHECK(dup == targets.end(), Block,
                 "destination block " << (dup == targets.end() ? 0 : *dup)
                                      << " appears twice: each may be written once per transfer");
    for (int64_t layer : layers) {
        KVMOVE_CHECK(layer >= 0 && layer < cache_.num_layers(), Config,
                     "layer " << layer << " is out of range: layers are in [0, "
                              << cache_.num_layers() << ")");
    }
    KVMOVE_CHECK(
        !notify || notify->size() <= kMaxNotifyBytes, Config,
        "notification of " << notify->size() << " bytes exceeds the limit of " << kMaxNotifyBytes);
}

// One put or get per range (here: local, there: remote).
void Agent::post_ranges(Direction direction, Peer& peer, const std::vector<RangePair>& ranges,
                        Transfer& transfer) {
    if (faults_ && faults_->fail_post()) {
        transfer.fail(ErrorKind::Transfer, "posting failed (injected fault)");
        return;
    }
    ucp_request_param_t param{};  // no callback: the flush that follows reports completion
    for (const RangePair& op : ranges) {
        void* local = reinterpret_cast<void*>(op.here);
        ucp_rkey_h rkey = peer.rkeys[op.there_segment].get();  // decode() bounded the index
        ucs_status_ptr_t request =
            direction == Direction::Put
                ? ucp_put_nbx(peer.endpoint->get(), local, op.nbytes, op.there, rkey, &param)
                : ucp_get_nbx(peer.endpoint->get(), local, op.nbytes, op.there, rkey, &param);
        if (UCS_PTR_IS_ERR(request)) {
            transfer.fail(ErrorKind::Transfer, "posting " + std::to_string(op.nbytes) + " bytes: " +
                                                   status_text(UCS_PTR_STATUS(request)));
            return;
        }
        if (request != nullptr) {
            ucp_request_free(request);  // completes in the background; the flush waits for it
        }
    }
}

Agent::InFlight* Agent::track(std::unique_ptr<InFlight> entry) {
    InFlight* raw = entry.get();
    in_flight_.emplace(raw->transfer.get(), std::move(entry));
    if (raw->notify && raw->peer != nullptr) {
        raw->peer->notify_order.push_back(raw);
    }
    return raw;
}

void Agent::post_flush(InFlight* entry) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &Agent::on_flush;
    param.user_data = entry;
    ucs_status_ptr_t request = ucp_ep_flush_nbx(entry->peer->endpoint->get(), &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) {
        complete_flush(entry, UCS_PTR_STATUS(request));
        drain_deferred();
    }
}

void Agent::on_flush(void* request, ucs_status_t status, void* user_data) {
    ucp_request_free(request);
    auto entry = static_cast<InFlight*>(user_data);
    entry->agent->complete_flush(entry, status);
}

// Every byte of the transfer is now in place on the destination side.
void Agent::complete_flush(InFlight* entry, ucs_status_t status) {
    if (!entry->notify) {
        finish(entry, status);
        return;
    }
    // Sent (or failed) by drain_deferred(), outside UCX's callback, in posting order.
    entry->flushed = true;
    entry->flush_status = status;
    flushed_.push_back(entry);
}

// Sends the peer's notifications whose flushes are done, up to the first that is not.
void Agent::release_notifications(Peer& peer) {
    while (!peer.notify_order.empty() && peer.notify_order.front()->flushed) {
        InFlight* entry = peer.notify_order.front();
        peer.notify_order.pop_front();
        if (entry->flush_status != UCS_OK) {
            finish(entry, entry->flush_status);
        } else {
            send_notification(entry);
        }
    }
}

void Agent::detach_transfers(const Peer* peer) {
    for (auto& [transfer, entry] : in_flight_) {
        if (entry->peer == peer) {
            entry->peer = nullptr;
        }
    }
}

// Sends what UCX callbacks deferred: posting from inside a callback is not allowed.
void Agent::drain_deferred() {
    drain_copies();
    while (!flushed_.empty() || streams_.has_deferred()) {
        std::vector<InFlight*> ready;
        ready.swap(flushed_);
        std::vector<Peer*> peers;  // collected first: releasing one may finish others
        for (InFlight* entry : ready) {
            if (entry->peer == nullptr) {
                finish(entry, UCS_ERR_CANCELED);  // the peer was removed after the flush
            } else if (std::find(peers.begin(), peers.end(), entry->peer) == peers.end()) {
                peers.push_back(entry->peer);
            }
        }
        for (Peer* peer : peers) {
            release_notifications(*peer);
        }
        streams_.drain();
    }
    send_delayed(false);
}

void Agent::send_notification(InFlight* entry) {
    if (entry->peer == nullptr) {
        finish(entry, UCS_ERR_CANCELED);  // the peer was removed after the flush
        return;
    }
    if (faults_) {
        if (faults_->drop_message()) {
            finish(entry, UCS_OK);  // lost on the way, as far as the sender can tell
            return;
        }
        if (const double delay = faults_->message_delay_seconds(); delay > 0) {
            delayed_.emplace_back(steady_seconds() + delay, entry);  // in order: same delay
            return;
        }
    }
    post_notification(entry);
}

// Sends the notifications a fault held back, those due (or all).
void Agent::send_delayed(bool all) {
    const double now = steady_seconds();
    while (!delayed_.empty() && (all || delayed_.front().first <= now)) {
        InFlight* entry = delayed_.front().second;
        delayed_.pop_front();
        if (entry->peer == nullptr) {
            finish(entry, UCS_ERR_CANCELED);
        } else {
            post_notification(entry);
        }
    }
}

void Agent::post_notification(InFlight* entry) {
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &Agent::on_notify_sent;
    param.user_data = entry;
    // Eager: the receiver's handler sees the whole payload at once. Reply: the receiver knows
    // the message by our endpoint (the only thing it trusts), not by any name in it.
    param.flags =
        (faults_ && faults_->rndv_message() ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER) |
        UCP_AM_SEND_FLAG_REPLY;
    const std::string& payload = *entry->notify;
    ucs_status_ptr_t request = ucp_am_send_nbx(entry->peer->endpoint->get(), entry->am_id, nullptr,
                                               0, payload.data(), payload.size(), &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) {
        finish(entry, UCS_PTR_STATUS(request));
    }
}

void Agent::on_notify_sent(void* request, ucs_status_t status, void* user_data) {
    ucp_request_free(request);
    auto entry = static_cast<InFlight*>(user_data);
    entry->agent->finish(entry, status);
}

void Agent::finish(InFlight* entry, ucs_status_t status) {
    PortOutcome outcome = outcome_of(status);
    if (entry->on_done) {
        entry->on_done(outcome);
    }
    if (outcome.ok) {
        entry->transfer->finish();
    } else {
        entry->transfer->fail(outcome.kind, outcome.error);
    }
    in_flight_.erase(entry->transfer.get());
}

void Agent::on_peer_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto peer = static_cast<Peer*>(arg);
    peer->agent->peer_failed(*peer, "UCX reported " + status_text(status));
}

void Agent::peer_failed(Peer& peer, const std::string& failure) {
    peer.failure = failure;
    peer.mapping.reset();  // unmapped once the copies in flight stop (they are cancelled)
    fail_peer_transfers(&peer, "the peer failed: " + peer.failure);
    streams_.peer_failed(peer.meta.name, ErrorKind::Peer,
                         "peer '" + peer.meta.name + "' failed: " + peer.failure);
}

void Agent::fail_peer_transfers(const Peer* peer, const std::string& reason) {
    for (auto& [transfer, entry] : in_flight_) {
        if (entry->peer == peer) {
            transfer->fail(ErrorKind::Peer, reason);
            if (entry->copy) {
                entry->copy->cancel();
            }
        }
    }
}

const Agent::Peer* Agent::sender_of(const ucp_am_recv_param_t* param, size_t nbytes, size_t limit) {
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || nbytes > limit) {
        // A rendezvous message's data is a descriptor, not the message; kvmove sends neither
        // that nor messages over the limit.
        ++messages_dropped_;
        KVMOVE_LOG(Warning, "agent",
                   "agent '" << name_ << "' dropped a "
                             << (nbytes > limit ? "too large" : "rendezvous") << " message of "
                             << nbytes << " bytes");
        return nullptr;
    }
    auto it = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? by_ep_.find(param->reply_ep)
                                                                   : by_ep_.end();
    if (it == by_ep_.end() || !it->second->failure.empty()) {
        ++unknown_senders_;
        KVMOVE_LOG(Warning, "agent",
                   "agent '" << name_ << "' dropped a message of " << nbytes
                             << " bytes from an endpoint that is no peer's");
        return nullptr;
    }
    return it->second;
}

ucs_status_t Agent::on_notification(void* arg, const void*, size_t, void* data, size_t nbytes,
                                    const ucp_am_recv_param_t* param) {
    auto agent = static_cast<Agent*>(arg);
    const Peer* peer = agent->sender_of(param, nbytes, kMaxNotifyBytes);
    if (peer == nullptr) {
        return UCS_OK;
    }
    {
        std::lock_guard<std::mutex> lock(agent->notify_mu_);
        size_t& queued = agent->queued_[peer->meta.name];
        if (queued >= kMaxQueuedNotifications) {
            ++agent->messages_dropped_;
            return UCS_OK;  // its consumer is not keeping up: the peer may not fill our memory
        }
        ++queued;
        agent->received_.emplace_back(peer->meta.name,
                                      std::string(static_cast<const char*>(data), nbytes));
    }
    agent->notify_cv_.notify_all();
    return UCS_OK;  // the payload was copied; UCX may release it
}

std::vector<std::pair<std::string, std::string>> Agent::notifications() {
    std::lock_guard<std::mutex> lock(notify_mu_);
    std::vector<std::pair<std::string, std::string>> out(received_.begin(), received_.end());
    received_.clear();
    queued_.clear();
    return out;
}

std::pair<std::string, std::string> Agent::wait_notification(double timeout_seconds) {
    check_timeout(timeout_seconds);
    if (auto got = poll_notification(std::min(timeout_seconds, kPollNotifySeconds))) {
        return *got;
    }
    std::unique_lock<std::mutex> lock(notify_mu_);
    bool got = notify_cv_.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
                                   [this] { return !received_.empty() || closed_; });
    KVMOVE_CHECK(got && !received_.empty(), Timeout,
                 "no notification for agent '" << name_ << "' within " << timeout_seconds << " s"
                                               << (closed_ ? " (agent closed)" : ""));
    auto out = std::move(received_.front());
    received_.pop_front();
    --queued_[out.first];
    return out;
}

// The first moments of a wait: this thread progresses the worker itself, so a notification
// that comes soon is delivered without waking two threads (the progress thread from its poll,
// then this one from the condition variable), each wake-up costing tens of microseconds on a
// busy machine. The worker is only tried: the progress thread may be delivering it right now.
std::optional<std::pair<std::string, std::string>> Agent::poll_notification(double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    do {
        {
            std::lock_guard<std::mutex> lock(notify_mu_);
            if (!received_.empty()) {
                auto out = std::move(received_.front());
                received_.pop_front();
                --queued_[out.first];
                return out;
            }
            if (closed_) {
                return std::nullopt;
            }
        }
        std::unique_lock<std::mutex> worker(worker_mu_, std::try_to_lock);
        if (worker.owns_lock() && !stop_) {
            ucp_worker_progress(worker_.get());
            drain_deferred();
        }
    } while (std::chrono::steady_clock::now() < until);
    return std::nullopt;
}

std::shared_ptr<SaveStream> Agent::stream_to(const std::string& peer,
                                             const std::vector<BlockId>& local_ids,
                                             const std::vector<BlockId>& remote_ids,
                                             const std::string& request_id, uint64_t epoch,
                                             bool checksums) {
    KVMOVE_CHECK(!checksums || !cache_.on_device(), Config,
                 "checksums are computed on the host: this cache is on a device");
    return streams_.stream_to(peer, local_ids, remote_ids, request_id, epoch, checksums);
}

std::shared_ptr<LoadStream> Agent::expect(const std::string& peer, const std::string& request_id,
                                          const std::vector<BlockId>& local_ids,
                                          double lease_seconds) {
    return streams_.expect(peer, request_id, local_ids, lease_seconds);
}

// ---- StreamPort: the transport under layer streams -----------------------------------

void Agent::run_locked(const std::function<void()>& fn) {
    WorkerLock lock(*this);
    fn();
    if (!closed_) {
        drain_deferred();
        ucp_worker_signal(worker_.get());  // wake the progress thread if it sleeps
    }
}

void Agent::check_put(const std::string& peer, const std::vector<BlockId>& local_ids,
                      const std::vector<BlockId>& remote_ids) const {
    validate(live_peer(peer), Direction::Put, local_ids, remote_ids,
             cache_.geometry().layers_or_all(std::nullopt), std::nullopt);
}

void Agent::check_sender(const std::string& peer) const {
    const AgentMetadata& meta = live_peer(peer).meta;
    std::string difference =
        shape_difference(cache_.num_layers(), shape_, meta.num_layers, meta.shape, peer);
    KVMOVE_CHECK(difference.empty(), Config, "KV layouts differ: " << difference);
}

bool Agent::peer_alive(const std::string& peer) const {
    auto it = peers_.find(peer);
    return it != peers_.end() && it->second->failure.empty();
}

uint32_t Agent::peer_incarnation(const std::string& peer) const {
    return live_peer(peer).meta.incarnation;
}

void Agent::disconnect(const std::string& peer, const std::string& reason) {
    auto it = peers_.find(peer);
    if (it != peers_.end()) {
        drop_peer(it, true, ErrorKind::Peer, "peer '" + peer + "' was disconnected: " + reason);
    }
}

StreamStats Agent::stream_stats() const {
    StreamStats stats = streams_.stats();
    stats.unknown_senders = unknown_senders_;
    stats.messages_dropped = messages_dropped_;
    return stats;
}

void Agent::put_then_send(const std::string& peer_name, const std::vector<BlockId>& local_ids,
                          const std::vector<BlockId>& remote_ids, int64_t layer,
                          std::string message, PortDone done) {
    if (!peer_alive(peer_name)) {
        done({false, ErrorKind::Peer, "peer '" + peer_name + "' is gone"});
        return;
    }
    Peer& peer = *peers_.at(peer_name);
    std::vector<RangePair> ranges =
        pair_ranges(cache_.geometry(), local_ids, peer.geometry, remote_ids, {layer});
    auto transfer = std::make_shared<Transfer>(peer_name, local_ids.size() * cache_.block_nbytes(),
                                               ranges.size());
    if (peer.mapping) {
        auto entry = std::make_unique<InFlight>(this, transfer, &peer, std::move(message));
        entry->am_id = kStreamAmId;
        entry->on_done = std::move(done);
        if (faults_ && !ranges.empty() && !cache_.on_device() && faults_->corrupt_layer()) {
            const RangePair& first = ranges.front();
            entry->corrupt_byte =
                std::make_unique<uint8_t>(*reinterpret_cast<const uint8_t*>(first.here) ^ 0xFF);
            entry->corrupt_at = reinterpret_cast<uint8_t*>(
                peer.mapping->at(first.there_segment, first.there));
        }
        post_copies(Direction::Put, peer, ranges, std::move(entry));
        return;
    }
    post_ranges(Direction::Put, peer, ranges, *transfer);
    if (transfer->state() != TransferState::Pending) {
        done({false, ErrorKind::Transfer, transfer->error()});
        return;
    }
    auto entry = std::make_unique<InFlight>(this, transfer, &peer, std::move(message));
    entry->am_id = kStreamAmId;
    entry->on_done = std::move(done);
    if (faults_ && !ranges.empty() && !cache_.on_device() && faults_->corrupt_layer()) {
        // One byte of the layer lands flipped: fenced behind the layer's own puts, flushed with
        // them, before its Layer message.
        const RangePair& first = ranges.front();
        entry->corrupt_byte =
            std::make_unique<uint8_t>(*reinterpret_cast<const uint8_t*>(first.here) ^ 0xFF);
        ucp_worker_fence(worker_.get());
        ucp_request_param_t param{};
        ucs_status_ptr_t request =
            ucp_put_nbx(peer.endpoint->get(), entry->corrupt_byte.get(), 1, first.there,
                        peer.rkeys[first.there_segment].get(), &param);
        if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
            ucp_request_free(request);
        }
    }
    post_flush(track(std::move(entry)));
}

double Agent::post_delay_seconds() {
    return faults_ ? faults_->post_delay_seconds() : 0;
}

std::map<std::string, uint64_t> Agent::fault_counts() const {
    return faults_ ? faults_->counts() : std::map<std::string, uint64_t>{};
}

void Agent::send(const std::string& peer_name, std::string message, PortDone done) {
    if (!peer_alive(peer_name)) {
        done({false, ErrorKind::Peer, "peer '" + peer_name + "' is gone"});
        return;
    }
    auto transfer = std::make_shared<Transfer>(peer_name, 0, 0);
    auto entry =
        std::make_unique<InFlight>(this, transfer, peers_.at(peer_name).get(), std::move(message));
    entry->am_id = kStreamAmId;
    entry->on_done = std::move(done);
    entry->flushed = true;  // nothing to flush, but it keeps its place behind earlier ones
    Peer* peer = entry->peer;
    track(std::move(entry));
    release_notifications(*peer);
}

ucs_status_t Agent::on_stream_am(void* arg, const void*, size_t, void* data, size_t nbytes,
                                 const ucp_am_recv_param_t* param) {
    auto agent = static_cast<Agent*>(arg);
    const Peer* peer = agent->sender_of(param, nbytes, kMaxStreamMessageBytes);
    if (peer != nullptr) {
        agent->streams_.on_message(peer->meta.name, data, nbytes);
    }
    return UCS_OK;  // the data was copied; UCX may release it
}

void Agent::progress_loop() {
    ucp_worker_h worker = worker_.get();
    int idle = 0;
    double last_tick = 0;
    double last_check = 0;
    while (!stop_) {
        unsigned progressed = 0;
        // Other threads that want the worker go first: std::mutex is not fair, and this
        // loop would otherwise take it back before a woken waiter runs, for as long as it
        // spins (measured: 16 MB layer puts landing 40 ms late instead of 2 ms).
        while (lock_waiters_.load(std::memory_order_relaxed) > 0) {
            std::this_thread::yield();
        }
        {
            std::lock_guard<std::mutex> lock(worker_mu_);
            progressed = ucp_worker_progress(worker);
            const double now = steady_seconds();
            if (now - last_check >= kCheckPeersSeconds) {  // mapped peers' processes
                check_mapped_peers();
                last_check = now;
            }
            if (now - last_tick >= kTickSeconds) {  // the streams' deadlines
                streams_.tick(now);
                last_tick = now;
            }
            drain_deferred();
        }
        if (progressed > 0 || ++idle < kIdleSpins) {
            idle = progressed > 0 ? 0 : idle;
            std::this_thread::yield();
            continue;
        }
        idle = 0;
        ucs_status_t armed = UCS_OK;
        double until_deadline = 0;
        {
            std::lock_guard<std::mutex> lock(worker_mu_);
            armed = ucp_worker_arm(worker);
            double next = streams_.next_deadline();
            if (!delayed_.empty()) {
                next = std::min(next, delayed_.front().first);
            }
            until_deadline = next - steady_seconds();
        }
        if (armed == UCS_OK) {
            // Sleep until there is work, the next deadline, or kSleepMs (to see stop_).
            const double ms = std::clamp(until_deadline * 1e3 + 1, 0.0, double(kSleepMs));
            pollfd fd{event_fd_, POLLIN, 0};
            poll(&fd, 1, static_cast<int>(ms));
        }
    }
}

}  // namespace kvmove
