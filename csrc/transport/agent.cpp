#include "transport/agent.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "common/log.h"
#include "transport/agent_internal.h"
#include "transport/peer_mapping.h"
#include "transport/ucx_path.h"

namespace kvmove {

namespace {

constexpr double kCloseSeconds = 2.0;  // how long close() lets pending work finish

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
    KVMOVE_CHECK(
        config_.copy_threads >= 0 && config_.copy_threads <= kMaxCopyThreads, Config,
        "copy_threads must be in [0, " << kMaxCopyThreads << "], got " << config_.copy_threads);
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
    {
        std::lock_guard<std::mutex> aside(aside_mu_);  // no lost wake-up of step_aside()
    }
    aside_cv_.notify_all();
    ucp_worker_signal(worker_.get());  // wakes the progress thread and any driving waiter
    driving_->detach();
    progress_thread_.join();
    received_.close();  // wake wait_notification() callers: nothing more will come
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
        peer->path->close(!peer->failure.empty(), std::max(left, 0.05));
        detach_transfers(peer.get());
    }
    // Only now, with every connection closed, are the leases released.
    streams_.close("agent '" + name_ + "' closed");
    peers_.clear();
    polling_.clear();
    retired_.clear();
    worker_.reset();  // may still complete requests: their callbacks need in_flight_ entries
    in_flight_.clear();
    flushed_.clear();
    registrations_.clear();
    context_.reset();
}

void Agent::check_open() const {
    KVMOVE_CHECK(!closed_, Config, "agent '" << name_ << "' is closed");
}

// ---- transfers ------------------------------------------------------------------------

std::shared_ptr<Transfer> Agent::write(const std::string& peer,
                                       const std::vector<BlockId>& local_ids,
                                       const std::vector<BlockId>& remote_ids,
                                       const std::optional<std::vector<int64_t>>& layers,
                                       const std::optional<std::string>& notify,
                                       TrafficClass traffic) {
    return start(Direction::Put, peer, local_ids, remote_ids, layers, notify, traffic);
}

std::shared_ptr<Transfer> Agent::read(const std::string& peer,
                                      const std::vector<BlockId>& local_ids,
                                      const std::vector<BlockId>& remote_ids,
                                      const std::optional<std::vector<int64_t>>& layers,
                                      const std::optional<std::string>& notify,
                                      TrafficClass traffic) {
    return start(Direction::Get, peer, local_ids, remote_ids, layers, notify, traffic);
}

std::shared_ptr<Transfer> Agent::start(Direction direction, const std::string& peer_name,
                                       const std::vector<BlockId>& local_ids,
                                       const std::vector<BlockId>& remote_ids,
                                       const std::optional<std::vector<int64_t>>& layers,
                                       const std::optional<std::string>& notify,
                                       TrafficClass traffic) {
    const std::vector<int64_t> wanted = cache_.geometry().layers_or_all(layers);
    WorkerLock lock(*this);
    check_open();  // under the lock: close() tears the worker down holding it
    check_peers();
    Peer& peer = live_peer(peer_name);
    validate(peer, direction, local_ids, remote_ids, wanted, notify);
    auto t0 = std::chrono::steady_clock::now();
    PathBatch batch;
    batch.direction = direction;
    batch.traffic = traffic;
    batch.ranges = pair_ranges(cache_.geometry(), local_ids, peer.geometry, remote_ids, wanted);
    auto transfer = std::make_shared<Transfer>(
        peer_name, local_ids.size() * wanted.size() * cache_.block_nbytes(), batch.ranges.size());
    post(peer, std::move(batch), track(std::make_unique<InFlight>(this, transfer, &peer, notify)));
    transfer->posted(seconds_since(t0));
    drain_deferred();  // a batch done at once (an inline copy, a failed post) completes now
    wake_for_paths();
    return transfer;
}

std::shared_ptr<Transfer> Agent::notify(const std::string& peer_name, const std::string& payload) {
    KVMOVE_CHECK(
        payload.size() <= kMaxNotifyBytes, Config,
        "notification of " << payload.size() << " bytes exceeds the limit of " << kMaxNotifyBytes);
    WorkerLock lock(*this);
    check_open();
    check_peers();
    Peer& peer = live_peer(peer_name);
    auto transfer = std::make_shared<Transfer>(peer_name, 0, 0);
    queue_message(peer, track(std::make_unique<InFlight>(this, transfer, &peer, payload)));
    drain_deferred();
    wake_for_paths();
    return transfer;
}

void Agent::send_raw_stream_message(const std::string& peer, std::string message) {
    run_locked([&] {
        live_peer(peer);
        send(peer, std::move(message), [](const PortOutcome&) {});
    });
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

// ---- completion, in each peer's posting order -----------------------------------------

Agent::InFlight* Agent::track(std::unique_ptr<InFlight> entry) {
    InFlight* raw = entry.get();
    in_flight_.emplace(raw->transfer.get(), std::move(entry));
    raw->transfer->drive_with(driving_);
    if (raw->notify && raw->peer != nullptr) {
        raw->peer->notify_order.push_back(raw);
    }
    return raw;
}

// Posts the entry's batch on the peer's path; its landing is recorded by landed().
void Agent::post(Peer& peer, PathBatch batch, InFlight* entry) {
    peer.path->post(std::move(batch),
                    [entry](const PortOutcome& o) { entry->agent->landed(entry, o); });
    polling_.push_back(peer.path);  // poll_paths() drops it again once it has nothing due
}

// A message alone: nothing to land, but it keeps its place behind the peer's earlier ones.
// Marked landed here, not through landed(): that would also queue it in flushed_, where it
// would stay after release_notifications() below sent and finished (freed) it.
void Agent::queue_message(Peer& peer, InFlight* entry) {
    entry->landed = true;
    release_notifications(peer);
}

// Every byte of the entry's batch is in place on the destination side (or it failed). This
// may run inside a UCX callback: a notification is sent later, by drain_deferred().
void Agent::landed(InFlight* entry, const PortOutcome& outcome) {
    if (!entry->notify) {
        finish(entry, outcome);
        return;
    }
    entry->landed = true;
    entry->outcome = outcome;
    flushed_.push_back(entry);
}

// Sends the peer's notifications whose batches landed, up to the first that has not.
void Agent::release_notifications(Peer& peer) {
    while (!peer.notify_order.empty() && peer.notify_order.front()->landed) {
        InFlight* entry = peer.notify_order.front();
        peer.notify_order.pop_front();
        // Released now, perhaps before drain_deferred() saw it land: flushed_ must not keep a
        // pointer to an entry finish() frees.
        flushed_.erase(std::remove(flushed_.begin(), flushed_.end(), entry), flushed_.end());
        if (!entry->outcome.ok) {
            finish(entry, entry->outcome);
            continue;
        }
        std::string message = entry->make_notify ? entry->make_notify() : std::move(*entry->notify);
        peer.path->send(entry->am_id, std::move(message), false,
                        [entry](const PortOutcome& o) { entry->agent->finish(entry, o); });
        polling_.push_back(peer.path);
    }
}

// Completes what landed and sends what UCX callbacks deferred: posting from inside a
// callback is not allowed.
void Agent::drain_deferred() {
    poll_paths();
    while (!flushed_.empty() || streams_.has_deferred()) {
        std::vector<InFlight*> ready;
        ready.swap(flushed_);
        std::vector<Peer*> peers;  // collected first: releasing one may finish others
        for (InFlight* entry : ready) {
            if (entry->peer == nullptr) {
                finish(entry, outcome_of(UCS_ERR_CANCELED));  // its peer went after it landed
            } else if (std::find(peers.begin(), peers.end(), entry->peer) == peers.end()) {
                peers.push_back(entry->peer);
            }
        }
        for (Peer* peer : peers) {
            release_notifications(*peer);
        }
        streams_.drain();
        poll_paths();
    }
    // A stream waiting for its receiver's Go or Ack is a hand-off under way: the less urgent
    // traffic keeps off, on the copy threads and the paced paths alike.
    const bool held = streams_.answers_awaited() > 0;
    if (held != handoff_held_) {
        handoff_held_ = held;
        pacer_->held = held;
        if (!held) {
            pacer_->handoff_ended = steady_seconds();  // the linger starts
        }
        if (copier_) {
            copier_->hold_background(held);
        }
    }
}

// Lets each path with work pending complete what is done; forgets those with none left.
void Agent::poll_paths() {
    if (polling_.empty()) {
        retired_.clear();
        return;
    }
    const double now = steady_seconds();
    std::vector<std::shared_ptr<Path>> paths;
    paths.swap(polling_);
    std::sort(paths.begin(), paths.end());
    paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
    for (const std::shared_ptr<Path>& path : paths) {
        if (path->poll(now)) {
            polling_.push_back(path);
        }
    }
    retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                  [this](const auto& r) {
                                      return std::find(polling_.begin(), polling_.end(),
                                                       r.second) == polling_.end();
                                  }),
                   retired_.end());
}

void Agent::finish(InFlight* entry, const PortOutcome& outcome) {
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

// ---- notifications received -----------------------------------------------------------

Notification Agent::wait_notification(double timeout_seconds) {
    check_timeout(timeout_seconds);
    std::optional<Notification> got;
    progress_until([&] { return (got = received_.try_take()).has_value(); }, timeout_seconds);
    KVMOVE_CHECK(got.has_value(), Timeout,
                 "no notification for agent '" << name_ << "' within " << timeout_seconds << " s"
                                               << (closed_ ? " (agent closed)" : ""));
    return std::move(*got);
}

}  // namespace kvmove
