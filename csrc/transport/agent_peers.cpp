// The Agent's peers: adding one (its path chosen: mapped memory on this host, else UCX,
// wrapped for fault injection when asked), its death, its removal, and who a received message
// came from.
#include <algorithm>
#include <thread>

#include "common/log.h"
#include "transport/agent.h"
#include "transport/agent_internal.h"
#include "transport/faulty_path.h"
#include "transport/mapped_path.h"
#include "transport/ucx_path.h"

namespace kvmove {

namespace {

constexpr double kDropSeconds = 2.0;  // how long a dropped peer's connection may take to close

}  // namespace

// A run of a peer is told from another by its incarnation, never by its clock
// (transport/peer_runs.h): metadata of a run this agent saw replaced is a replay, refused;
// any incarnation not seen under the name is a new run, which replaces the known one.
std::string Agent::add_peer(const std::vector<uint8_t>& metadata, bool rejoin) {
    AgentMetadata meta = decode(metadata);
    WorkerLock lock(*this);
    check_open();
    KVMOVE_CHECK(!runs_.retired(meta.name, meta.incarnation), Peer,
                 "metadata of '" << meta.name << "' is a replay: its run (incarnation "
                                 << meta.incarnation << ") was replaced by incarnation "
                                 << runs_.current(meta.name) << ", and agent '" << name_
                                 << "' refuses a retired run");
    auto old = peers_.find(meta.name);
    if (old != peers_.end()) {
        const AgentMetadata& known = old->second->meta;
        const bool same =
            known.incarnation == meta.incarnation && known.worker_address == meta.worker_address;
        // rejoin (connect, and a listener answering one): the peer asks for fresh endpoints
        // both ways. It may have dropped ours (a disconnect, a remove_peer) while ours looks
        // alive here, and messages between an old endpoint and a new one are nobody's.
        KVMOVE_CHECK(rejoin || !old->second->failure.empty() || !same, Peer,
                     "peer '" << meta.name << "' is already added to agent '" << name_ << "'");
        // One run has one worker address: the same incarnation elsewhere is no run of it.
        KVMOVE_CHECK(same || meta.incarnation != known.incarnation, Peer,
                     "metadata of '" << meta.name << "' names the run agent '" << name_
                                     << "' knows (incarnation " << meta.incarnation
                                     << ") with another worker address");
        // It came back (a new incarnation), or reconnects: its old connection goes first, and
        // everything of the old one fails.
        drop_peer(old, true, ErrorKind::Peer,
                  same ? "peer '" + meta.name + "' reconnected"
                       : "peer '" + meta.name + "' restarted (incarnation " +
                             std::to_string(known.incarnation) + " -> " +
                             std::to_string(meta.incarnation) + ")");
    }
    KVMOVE_CHECK(static_cast<int64_t>(peers_.size()) < config_.max_peers, Peer,
                 "agent '" << name_ << "' has " << peers_.size() << " peers, its limit "
                           << "(max_peers): cannot add '" << meta.name << "'");
    auto peer = std::make_unique<Peer>(this, meta);
    peer->path = make_path(peer->meta, peer.get());
    std::string unwatched;
    peer->process = PidfdWatch::open(peer->meta.host, unwatched);
    std::string peer_name = peer->meta.name;
    by_ep_[peer->path->endpoint()] = peer.get();
    peers_.emplace(peer_name, std::move(peer));
    runs_.added(peer_name, meta.incarnation,
                [this](const std::string& name) { return peers_.count(name) > 0; });
    return peer_name;
}

// The peer's path: its memory mapped here when it is on this host and both allow it, else
// UCX, paced so that hand-offs go first (paced_path.h); wrapped in a FaultyPath when this
// agent injects faults.
std::shared_ptr<Path> Agent::make_path(const AgentMetadata& meta, Peer* peer) {
    auto ucx = std::make_unique<UcxPath>(worker_.get(), meta, config_.peer_errors,
                                         &Agent::on_peer_error, peer);
    std::unique_ptr<Path> path = mapped_path(meta, std::move(ucx));
    if (std::string(path->kind()) == "ucx") {
        path = std::make_unique<PacedPath>(std::move(path), pacer_);
    }
    if (faults_) {
        path = std::make_unique<FaultyPath>(std::move(path), *faults_, !cache_.on_device());
    }
    return path;
}

std::unique_ptr<Path> Agent::mapped_path(const AgentMetadata& meta, std::unique_ptr<UcxPath> ucx) {
    if (!config_.map_same_host || cache_.on_device()) {
        return ucx;
    }
    std::string why;
    std::shared_ptr<PeerMapping> mapping = PeerMapping::open(meta, why);
    KVMOVE_LOG(Debug, "agent",
               "agent '" << name_ << "' reaches peer '" << meta.name << "' "
                         << (mapping ? "through its mapped memory" : "over UCX: " + why));
    if (!mapping) {
        return ucx;
    }
    ucp_worker_h worker = worker_.get();  // the copier stops before the worker goes
    return std::make_unique<MappedPath>(
        std::move(mapping), meta.host.pid, std::move(ucx), [this]() -> Copier& { return copier(); },
        [worker] { ucp_worker_signal(worker); });
}

Copier& Agent::copier() {
    if (!copier_) {
        // Auto: one copy thread per two CPUs, 2 to 4: a copy is bound by memory bandwidth,
        // which a few threads fill (the rest of the CPUs belong to the engine), and a second
        // thread helps even on 2 CPUs (measured there, 524 MB: 3.5-4.1 GB/s with one thread,
        // 4.6-5.9 with two). The threads sleep between transfers.
        copier_ = std::make_unique<Copier>(
            config_.copy_threads > 0 ? config_.copy_threads : default_copy_threads(),
            threads_cpus_);
        copier_->hold_background(handoff_held_);
    }
    return *copier_;
}

void Agent::remove_peer(const std::string& name) {
    WorkerLock lock(*this);
    check_open();
    auto it = peers_.find(name);
    KVMOVE_CHECK(it != peers_.end(), Peer,
                 "unknown peer '" << name << "' for agent '" << name_ << "'");
    drop_peer(it, !it->second->failure.empty(), ErrorKind::Peer, "peer '" + name + "' was removed");
}

// Fails the peer's transfers, closes its connection (force: cancel what is posted; else flush
// it first), then ends its streams and releases its leases (the connection is gone), and
// forgets it.
void Agent::drop_peer(std::map<std::string, std::unique_ptr<Peer>>::iterator it, bool force,
                      ErrorKind kind, const std::string& reason) {
    const std::string name = it->first;
    Peer& peer = *it->second;
    by_ep_.erase(peer.path->endpoint());
    fail_peer_transfers(&peer, reason);
    peer.path->close(force, kDropSeconds);
    if (std::find(polling_.begin(), polling_.end(), peer.path) != polling_.end()) {
        retired_.emplace_back(name, peer.path);  // copies still under way (peer_quiet)
    }
    detach_transfers(&peer);
    for (InFlight* entry : peer.notify_order) {
        // Landed and waiting behind an earlier one: nothing will send it now (those still
        // in flushed_ are cancelled by drain_deferred(), their peer being null).
        if (entry->landed && std::find(flushed_.begin(), flushed_.end(), entry) == flushed_.end()) {
            finish(entry, outcome_of(UCS_ERR_CANCELED));
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

Agent::Peer& Agent::live_peer(const std::string& name) const {
    auto it = peers_.find(name);
    KVMOVE_CHECK(it != peers_.end(), Peer,
                 "unknown peer '" << name << "' for agent '" << name_ << "'");
    KVMOVE_CHECK(it->second->failure.empty(), Peer,
                 "peer '" << name << "' failed: " << it->second->failure);
    return *it->second;
}

std::vector<std::pair<std::string, std::string>> Agent::peer_transports(
    const std::string& name) const {
    WorkerLock lock(*this);
    check_open();
    return live_peer(name).path->transports();
}

std::string Agent::peer_path(const std::string& name) const {
    WorkerLock lock(*this);
    auto it = peers_.find(name);
    KVMOVE_CHECK(it != peers_.end(), Peer,
                 "unknown peer '" << name << "' for agent '" << name_ << "'");
    return it->second->path->kind();
}

BlockShape Agent::peer_shape(const std::string& name) const {
    WorkerLock lock(*this);
    auto it = peers_.find(name);
    KVMOVE_CHECK(it != peers_.end(), Peer,
                 "unknown peer '" << name << "' for agent '" << name_ << "'");
    return it->second->meta.shape;
}

bool Agent::peer_is_alive(const std::string& name) const {
    WorkerLock lock(*this);
    return peer_alive(name);
}

// A peer whose process is known dead (a mapped peer's pidfd) fails at once, as UCX's error
// callback would fail it.
void Agent::check_peers() {
    for (auto& [name, peer] : peers_) {
        std::string why;
        if (peer->failure.empty() && !peer->path->alive(why)) {
            peer_failed(*peer, why);
        }
    }
}

void Agent::on_peer_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto peer = static_cast<Peer*>(arg);
    peer->agent->peer_failed(*peer, std::string("UCX reported ") + ucs_status_string(status));
}

void Agent::peer_failed(Peer& peer, const std::string& failure) {
    peer.failure = failure;
    fail_peer_transfers(&peer, "the peer failed: " + peer.failure);
    streams_.peer_failed(peer.meta.name, ErrorKind::Peer,
                         "peer '" + peer.meta.name + "' failed: " + peer.failure);
}

// Fails the peer's transfers now; its path stops what is in flight (each still completes,
// failed, once it stopped).
void Agent::fail_peer_transfers(const Peer* peer, const std::string& reason) {
    for (auto& [transfer, entry] : in_flight_) {
        if (entry->peer == peer) {
            transfer->fail(ErrorKind::Peer, reason);
        }
    }
    peer->path->cancel();
}

void Agent::detach_transfers(const Peer* peer) {
    for (auto& [transfer, entry] : in_flight_) {
        if (entry->peer == peer) {
            entry->peer = nullptr;
        }
    }
}

// ---- messages received ----------------------------------------------------------------

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
    // Copied: UCX may release the data. Over the peer's cap (its consumer is not keeping up),
    // dropped: the peer may not fill our memory.
    if (peer != nullptr &&
        !agent->received_.put(
            {peer->meta.name, std::string(static_cast<const char*>(data), nbytes)})) {
        ++agent->messages_dropped_;
    }
    return UCS_OK;
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

}  // namespace kvmove
