// Agent: one UCX worker serving one KVCache — peers, one-sided block transfers, notifications,
// and the transport under layer streams (it is their StreamPort, stream/stream_port.h).
//
// How bytes reach a peer is its Path's business (transport/path.h: UCX puts and gets, or
// copies into a same-host peer's mapped memory, either wrapped for fault injection). The
// agent validates a transfer, pairs its ranges and posts them on the peer's path; it keeps
// each peer's notifications in the order of their transfers and sends one only once its
// bytes landed.
//
// Threads: a background progress thread drives the worker (over tcp a put is emulated with
// messages, so the target must progress even while its user is idle); user threads post
// transfers. One mutex serializes every worker call; UCX callbacks run inside
// ucp_worker_progress with that mutex held and never take it themselves. A thread waiting in
// wait_notification() or Transfer::wait() progresses the worker itself while the progress
// thread steps aside; whoever drives sleeps on the worker's event fd (ucp_worker_arm) when
// nothing is pending (agent_progress.cpp).
//
// Files: agent.cpp (life cycle, transfers, notification order), agent_progress.cpp (who
// progresses the worker), agent_peers.cpp (peers and their paths), agent_stream_port.cpp (the
// StreamPort).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/inbox.h"
#include "memory/kv_cache.h"
#include "stream/stream_protocol.h"
#include "transport/copier.h"
#include "transport/faults.h"
#include "transport/metadata.h"
#include "transport/paced_path.h"
#include "transport/path.h"
#include "transport/peer_runs.h"
#include "transport/transfer.h"
#include "transport/ucx.h"

namespace kvmove {

class UcxPath;

struct AgentConfig {
    std::string transports;            // UCX_TLS syntax; "" lets UCX choose
    bool peer_errors = true;           // UCP_ERR_HANDLING_MODE_PEER (+ peer_error_settings)
    double peer_timeout_seconds = 10;  // UCX keepalive: how long a silent peer lives
    StreamConfig streams;              // the streams' cancel and ack timeouts
    std::string faults;                // fault injection (transport/faults.h); "" for none
    std::string net_devices;           // UCX_NET_DEVICES syntax; "" lets UCX choose
    int64_t max_peers = 1024;
    // Same-host peers map each other's memory and copy directly (transport/mapped_path.h):
    // this agent offers its memfd to peers and maps theirs. false keeps UCX for everything.
    bool map_same_host = true;
    int copy_threads = 0;  // threads copying to mapped peers; 0: chosen from the CPUs
};

constexpr int kMaxCopyThreads = 64;
constexpr size_t kMaxNotifyBytes = 64 * 1024;
// Received notifications wait for notifications() / wait_notification(), at most this many
// from one peer (more are dropped and counted): a peer cannot fill this process's memory.
constexpr size_t kMaxQueuedNotifications = 1024;
constexpr size_t kMaxStreamMessageBytes = 64 * 1024 * 1024;

// A received notification: who sent it (attributed by endpoint) and its payload.
struct Notification {
    std::string peer;
    std::string payload;
};

class Agent : private StreamPort {
public:
    Agent(std::string name, KVCache& cache, BlockShape shape, AgentConfig config);
    ~Agent();
    Agent(const Agent&) = delete;
    Agent& operator=(const Agent&) = delete;

    const std::string& name() const { return name_; }
    uint32_t incarnation() const { return incarnation_; }
    bool closed() const { return closed_; }
    std::vector<uint8_t> metadata() const { return metadata_; }
    // rejoin: the same run of a peer announcing itself again (a connect: it may have dropped
    // our endpoint, or never got our answer) is no error: its old endpoint is replaced by a
    // fresh one (what was in flight fails).
    std::string add_peer(const std::vector<uint8_t>& metadata, bool rejoin = false);
    void remove_peer(const std::string& name);
    std::vector<std::string> peers() const;
    // The (transport, device) pairs UCX chose to reach a live peer (Endpoint::transports).
    std::vector<std::pair<std::string, std::string>> peer_transports(const std::string& name) const;
    // How transfers with the peer move: "mapped" (memcpy into its mapped memory, same host)
    // or "ucx" (Path::kind).
    std::string peer_path(const std::string& name) const;
    // What one block of one layer of the peer's cache holds (its metadata's shape: block
    // size, KV heads and which of the model's, dtype, order). PeerError for an unknown peer.
    BlockShape peer_shape(const std::string& name) const;
    // Whether name is a peer this agent can reach: added, and not failed.
    bool peer_is_alive(const std::string& name) const;

    // One-sided put (write) or get (read) of local_ids[i] <-> remote_ids[i] in the given
    // layers (all when nullopt); notify is delivered to the peer once the data is in place.
    // traffic: what it is for (copier.h: a hand-off's copies go before an offload's).
    std::shared_ptr<Transfer> write(const std::string& peer, const std::vector<BlockId>& local_ids,
                                    const std::vector<BlockId>& remote_ids,
                                    const std::optional<std::vector<int64_t>>& layers,
                                    const std::optional<std::string>& notify,
                                    TrafficClass traffic = TrafficClass::Handoff);
    std::shared_ptr<Transfer> read(const std::string& peer, const std::vector<BlockId>& local_ids,
                                   const std::vector<BlockId>& remote_ids,
                                   const std::optional<std::vector<int64_t>>& layers,
                                   const std::optional<std::string>& notify,
                                   TrafficClass traffic = TrafficClass::Handoff);
    // A notification alone (no data), after what was sent to the peer before.
    std::shared_ptr<Transfer> notify(const std::string& peer, const std::string& payload);

    // Layer streaming (stream/layer_stream.h, stream/stream_protocol.h). expect() leases
    // local_ids for request_id from peer, for lease_seconds; stream_to() sends local_ids[i] ->
    // remote_ids[i] of peer layer by layer, into the peer's lease `epoch`. Both validate
    // everything up front.
    std::shared_ptr<SaveStream> stream_to(const std::string& peer,
                                          const std::vector<BlockId>& local_ids,
                                          const std::vector<BlockId>& remote_ids,
                                          const std::string& request_id, uint64_t epoch,
                                          bool checksums);
    std::shared_ptr<LoadStream> expect(const std::string& peer, const std::string& request_id,
                                       const std::vector<BlockId>& local_ids, double lease_seconds);
    // The hand-off (stream/stream_message.h): the receiver offers a lease to its sender, the
    // sender takes the offers and streams into them, or declines them.
    std::shared_ptr<LoadStream> offer(const std::string& peer, const std::string& request_id,
                                      const std::vector<BlockId>& local_ids, double lease_seconds) {
        return streams_.offer(peer, request_id, local_ids, lease_seconds);
    }
    void offer_nothing(const std::string& peer, const std::string& request_id) {
        streams_.offer_nothing(peer, request_id);
    }
    std::vector<Offer> offers() { return streams_.offers(); }
    Offer wait_offer(double timeout_seconds) { return streams_.wait_offer(timeout_seconds); }
    void decline(const Offer& offer, const std::string& reason) { streams_.decline(offer, reason); }
    // For tests: `message` sent to the peer as a stream message, unchecked (what a peer that
    // does not follow the protocol could send).
    void send_raw_stream_message(const std::string& peer, std::string message);

    StreamStats stream_stats() const;
    // What fault injection did so far (empty when it is off).
    std::map<std::string, uint64_t> fault_counts() const;

    // Received notifications, oldest first; drains the queue.
    std::vector<Notification> notifications() { return received_.take_all(); }
    Notification wait_notification(double timeout_seconds);

    // Stops progress, fails pending transfers, releases UCX objects. Idempotent.
    void close();

private:
    struct Peer;
    struct InFlight;
    struct Driving;

    // agent.cpp: transfers and their notifications.
    std::shared_ptr<Transfer> start(Direction direction, const std::string& peer,
                                    const std::vector<BlockId>& local_ids,
                                    const std::vector<BlockId>& remote_ids,
                                    const std::optional<std::vector<int64_t>>& layers,
                                    const std::optional<std::string>& notify, TrafficClass traffic);
    void validate(const Peer& peer, Direction direction, const std::vector<BlockId>& local_ids,
                  const std::vector<BlockId>& remote_ids, const std::vector<int64_t>& layers,
                  const std::optional<std::string>& notify) const;
    InFlight* track(std::unique_ptr<InFlight> entry);
    void post(Peer& peer, PathBatch batch, InFlight* entry);
    void queue_message(Peer& peer, InFlight* entry);
    void landed(InFlight* entry, const PortOutcome& outcome);
    void release_notifications(Peer& peer);
    void drain_deferred();
    void poll_paths();
    void finish(InFlight* entry, const PortOutcome& outcome);
    // agent_progress.cpp: who progresses the worker, and when the progress thread sleeps.
    bool progress_until(const std::function<bool()>& done, double timeout_seconds);
    std::shared_ptr<Driving> make_driving();
    void progress_loop();
    void drive_round(int& idle, double max_seconds, double poll_seconds, double& last_progress);
    bool progress_once(bool& pending);
    void step_aside();
    void sleep_until_work(double max_seconds);
    void wake_for_paths();
    void check_open() const;

    // agent_peers.cpp: peers and their paths.
    Peer& live_peer(const std::string& name) const;
    std::shared_ptr<Path> make_path(const AgentMetadata& meta, Peer* peer);
    std::unique_ptr<Path> mapped_path(const AgentMetadata& meta, std::unique_ptr<UcxPath> ucx);
    Copier& copier();
    void check_peers();
    void peer_failed(Peer& peer, const std::string& failure);
    void drop_peer(std::map<std::string, std::unique_ptr<Peer>>::iterator it, bool force,
                   ErrorKind kind, const std::string& reason);
    void fail_peer_transfers(const Peer* peer, const std::string& reason);
    void detach_transfers(const Peer* peer);
    static void on_peer_error(void* arg, ucp_ep_h ep, ucs_status_t status);
    // The peer an active message came from (by its reply endpoint), or null: then it is
    // dropped. Rendezvous and oversize messages are dropped too.
    const Peer* sender_of(const ucp_am_recv_param_t* param, size_t nbytes, size_t limit);
    static ucs_status_t on_notification(void* arg, const void* header, size_t header_nbytes,
                                        void* data, size_t nbytes,
                                        const ucp_am_recv_param_t* param);
    static ucs_status_t on_stream_am(void* arg, const void* header, size_t header_nbytes,
                                     void* data, size_t nbytes, const ucp_am_recv_param_t* param);

    // agent_stream_port.cpp: StreamPort (stream/stream_port.h), for streams_.
    const std::string& local_name() const override { return name_; }
    double post_delay_seconds() override;
    void run_locked(const std::function<void()>& fn) override;
    void check_put(const std::string& peer, const std::vector<BlockId>& local_ids,
                   const std::vector<BlockId>& remote_ids) const override;
    void check_sender(const std::string& peer) const override;
    bool peer_alive(const std::string& peer) const override;
    uint32_t peer_incarnation(const std::string& peer) const override;
    void put_then_send(const std::string& peer, const std::vector<BlockId>& local_ids,
                       const std::vector<BlockId>& remote_ids, int64_t layer, uint64_t lease,
                       std::function<std::string()> message, PortDone done,
                       std::shared_ptr<PutChecksums> sums) override;
    bool checksums_on_copy(const std::string& peer) const override;
    void send(const std::string& peer, std::string message, PortDone done) override;
    void cancel_puts(const std::string& peer, uint64_t lease) override;
    bool peer_quiet(const std::string& peer) const override;
    uint32_t peer_run(const std::string& peer) const override;
    std::shared_ptr<const ProcessWatch> peer_process(const std::string& peer) const override;
    void disconnect(const std::string& peer, const std::string& reason) override;

    const std::string name_;
    KVCache& cache_;
    const BlockShape shape_;  // what each block of the cache holds
    const AgentConfig config_;
    const uint32_t incarnation_;                   // transport/metadata.h
    const std::unique_ptr<FaultInjector> faults_;  // null unless faults are asked for
    // UCX objects in dependency order: destroyed bottom-up.
    ContextPtr context_;
    WorkerPtr worker_;
    std::vector<std::unique_ptr<MemoryRegistration>> registrations_;  // one per segment
    std::unique_ptr<Copier> copier_;  // started with the first mapped put; signals worker_
    std::shared_ptr<Pacer> pacer_ = std::make_shared<Pacer>();  // its UCX paths' (paced_path.h)
    bool handoff_held_ = false;  // a stream waits for its receiver's answer (drain_deferred)
    // Where the copier's threads run: the CPUs of the thread that built this agent.
    CpuMask threads_cpus_ = CpuMask::of_this_thread();
    std::vector<uint8_t> metadata_;
    int event_fd_ = -1;

    mutable std::mutex worker_mu_;              // every worker call, peers_, in_flight_...
    mutable std::atomic<int> lock_waiters_{0};  // threads in WorkerLock waiting for worker_mu_
    // User threads progressing the worker while they wait (progress_until): while there is
    // one, the progress thread steps aside (waits on aside_cv_) instead of competing with it
    // for the worker and the CPU.
    int waiters_driving_ = 0;  // guarded by aside_mu_
    double last_tick_ = 0;     // when the streams' deadlines were last checked (worker_mu_)
    double last_check_ = 0;    // when the peers' liveness was last checked (worker_mu_)
    std::mutex aside_mu_;
    std::condition_variable aside_cv_;
    // What its transfers' waiters progress the worker through (Transfer::drive_with); detached
    // by close(), so that a Transfer outliving the agent never reaches it.
    const std::shared_ptr<Driving> driving_ = make_driving();

    // worker_mu_ for any thread but the progress thread, which yields to it.
    class WorkerLock {
    public:
        explicit WorkerLock(const Agent& agent) : agent_(agent) {
            agent_.lock_waiters_.fetch_add(1, std::memory_order_relaxed);
            agent_.worker_mu_.lock();
            agent_.lock_waiters_.fetch_sub(1, std::memory_order_relaxed);
        }
        ~WorkerLock() { agent_.worker_mu_.unlock(); }
        WorkerLock(const WorkerLock&) = delete;
        WorkerLock& operator=(const WorkerLock&) = delete;

    private:
        const Agent& agent_;
    };
    std::map<std::string, std::unique_ptr<Peer>> peers_;
    PeerRuns runs_;  // each peer name's current and retired runs: a restart or a replay
    // Each peer by its endpoint: how an incoming message is attributed (never by a name in it).
    std::unordered_map<ucp_ep_h, Peer*> by_ep_;
    std::unordered_map<Transfer*, std::unique_ptr<InFlight>> in_flight_;
    std::vector<InFlight*> flushed_;  // landed, notification still to send
    // Paths with work only poll() completes (copies, held messages), a gone peer's included:
    // each is kept until that work is done.
    std::vector<std::shared_ptr<Path>> polling_;
    // Paths of dropped peers (by name) whose copies were still under way; gone from here once
    // poll_paths() finds them done.
    std::vector<std::pair<std::string, std::shared_ptr<Path>>> retired_;
    StreamProtocol streams_;  // layer streams over this agent (guarded by worker_mu_)

    Inbox<Notification> received_{kMaxQueuedNotifications};
    std::atomic<uint64_t> unknown_senders_{0};
    std::atomic<uint64_t> messages_dropped_{0};

    std::atomic<bool> stop_{false};
    std::atomic<bool> closed_{false};
    std::thread progress_thread_;
};

}  // namespace kvmove
