// The Agent as the transport under layer streams (stream/stream_port.h): the stream
// protocol's lock is the worker lock, its puts and messages go on the peers' paths like any
// transfer's, in the same per-peer order.
#include "common/log.h"
#include "memory/block_checksum.h"
#include "transport/agent.h"
#include "transport/agent_internal.h"

namespace kvmove {

// ---- the streams' verbs --------------------------------------------------------------------

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

StreamStats Agent::stream_stats() const {
    StreamStats stats = streams_.stats();
    stats.unknown_senders = unknown_senders_;
    stats.messages_dropped = messages_dropped_;
    return stats;
}

std::map<std::string, uint64_t> Agent::fault_counts() const {
    return faults_ ? faults_->counts() : std::map<std::string, uint64_t>{};
}

// ---- StreamPort ------------------------------------------------------------------------

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

void Agent::cancel_puts(const std::string& peer, uint64_t lease) {
    auto it = peers_.find(peer);
    if (it != peers_.end()) {
        it->second->path->cancel_lease(lease);
    }
}

bool Agent::peer_quiet(const std::string& peer) const {
    for (const auto& [name, path] : retired_) {
        if (name == peer) {
            return false;
        }
    }
    return true;
}

uint32_t Agent::peer_run(const std::string& peer) const {
    auto it = peers_.find(peer);
    return it != peers_.end() ? it->second->meta.incarnation : 0;
}

std::shared_ptr<const ProcessWatch> Agent::peer_process(const std::string& peer) const {
    auto it = peers_.find(peer);
    return it != peers_.end() ? it->second->process : nullptr;
}

void Agent::disconnect(const std::string& peer, const std::string& reason) {
    auto it = peers_.find(peer);
    if (it != peers_.end()) {
        drop_peer(it, true, ErrorKind::Peer, "peer '" + peer + "' was disconnected: " + reason);
    }
}

double Agent::post_delay_seconds() {
    return faults_ ? faults_->post_delay_seconds() : 0;
}

void Agent::put_then_send(const std::string& peer_name, const std::vector<BlockId>& local_ids,
                          const std::vector<BlockId>& remote_ids, int64_t layer, uint64_t lease,
                          std::function<std::string()> message, PortDone done,
                          std::shared_ptr<PutChecksums> sums) {
    if (!peer_alive(peer_name)) {
        done({false, ErrorKind::Peer, "peer '" + peer_name + "' is gone"});
        return;
    }
    Peer& peer = *peers_.at(peer_name);
    PathBatch batch;
    batch.ranges = pair_ranges(cache_.geometry(), local_ids, peer.geometry, remote_ids, {layer});
    batch.lease = lease;
    if (sums) {
        sums->values.assign(local_ids.size(), 0);
        if (checksums_on_copy(peer_name)) {
            const Plane& plane = cache_.geometry().plane(layer, 0);  // one part (below)
            for (size_t i = 0; i < local_ids.size(); ++i) {
                batch.checksums.push_back(
                    {reinterpret_cast<const char*>(block_address(plane, local_ids[i])),
                     plane.block_nbytes, sums->seeds[i], &sums->values[i]});
            }
            batch.keep = sums;
        } else {  // the caller should have computed them: not on the copy, but right
            for (size_t i = 0; i < local_ids.size(); ++i) {
                sums->values[i] =
                    block_checksum(cache_.geometry(), layer, local_ids[i], sums->seeds[i]);
            }
        }
    }
    auto transfer = std::make_shared<Transfer>(peer_name, local_ids.size() * cache_.block_nbytes(),
                                               batch.ranges.size());
    auto entry = std::make_unique<InFlight>(this, transfer, &peer, std::string(), kStreamAmId,
                                            std::move(done));
    entry->make_notify = std::move(message);
    post(peer, std::move(batch), track(std::move(entry)));
}

// A block's bytes in a layer are one range (one part) and on the host: the copy threads
// hash each block's range as they copy.
bool Agent::checksums_on_copy(const std::string& peer_name) const {
    const auto it = peers_.find(peer_name);
    return it != peers_.end() && it->second->path && it->second->path->checksums_on_copy() &&
           cache_.geometry().num_parts() == 1 && !cache_.on_device();
}

void Agent::send(const std::string& peer_name, std::string message, PortDone done) {
    if (!peer_alive(peer_name)) {
        done({false, ErrorKind::Peer, "peer '" + peer_name + "' is gone"});
        return;
    }
    Peer& peer = *peers_.at(peer_name);
    auto transfer = std::make_shared<Transfer>(peer_name, 0, 0);
    queue_message(peer, track(std::make_unique<InFlight>(this, transfer, &peer, std::move(message),
                                                         kStreamAmId, std::move(done))));
}

}  // namespace kvmove
