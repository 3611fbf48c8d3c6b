// StreamProtocol: layer streams into leased blocks, over any StreamPort.
//
// The receiver is the authority over its blocks. expect() grants a lease: an epoch (the
// agent's incarnation in the high 32 bits, a counter below: never reused), the block ids and a
// deadline. A sender writes nothing until the receiver said Go to its Begin, and the receiver
// says Go at most once per lease, only while the lease stands:
//
//   sender                                   receiver
//     |                                        | expect(): lease E granted (deadline T)
//     | <------------- Offer(E, ids) by offer(), or E and the ids by a control plane ---
//     | offers(): taken (or decline(): Decline(E, why) -> the lease ends, nothing written)
//     | stream_to(E): Begin(E, ids hash) ----> | E granted, ids match: engaged
//     | <------------------------------ Go(E)  |   (or Refuse(E, why): nothing is written)
//     | save_layer(i): puts, flush, Layer(E,i) | layer i ready (verified, with checksums)
//     | ...                                    |
//     | finish(): Final(E, payload) ---------> | done; lease released: blocks reusable
//     | <----------------------------- Ack(E)  |
//
//   cancel() or deadline T on the receiver, lease engaged:
//     | <--------------------------- Cancel(E) | waiters fail now; blocks quarantined
//     | drop queued layers, flush posted ones  |
//     | Abort(E) ----------------------------> | released
//     |                  no Abort within the cancel timeout: the sender is disconnected
//
// So a lease's blocks go back only when its sender ended it (Final or Abort, both sent after
// its last put was flushed), when no sender ever engaged it, or when its sender's process
// exited. A sender that is cut off (disconnected, removed, replaced by a new run, or its
// endpoint failed) while it engaged a lease may still write: a mapped peer copies into our
// memory with memcpy, UCX shared memory and cma write without us, and UCX's tcp applies
// emulated puts of a connection we did not close. Such a lease stays quarantined: its load
// fails at once, but `released` stays false until the sender's process is known to have
// exited (transport/process_watch.h; polled every kQuarantinePollSeconds), or until the same
// run of it is a live peer again (it reconnected) and answers the Cancel the receiver then
// sends for each such lease (every kQuarantineCancelSeconds) with its Abort — which a sender sends
// only once nothing of that lease is in flight, its old connection's copies included
// (StreamPort::peer_quiet). A sender on another host or in another pid namespace that never comes
// back cannot be watched: its quarantine lasts until the agent closes. A timeout alone never frees
// a block. Messages for an epoch that is not leased (or not to that sender, or not in a state that
// allows them) are refused and counted. A sender whose Final is not acknowledged within the ack
// timeout fails.
//
// Locking: the protocol's state is guarded by the port's lock (stream_port.h): the user verbs
// take it through run_locked(); the port holds it when it calls on_message(), peer_failed(),
// tick(), drain() and the PortDone callbacks. Lock order: the port's lock, then a stream's own
// mutex, then the post or verify queue's mutex; neither queue mutex is held while taking the
// port's lock. Checksums are computed off the lock (the post thread, the verify thread).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/cpu_mask.h"
#include "stream/layer_stream.h"
#include "stream/offer_box.h"
#include "stream/stream_message.h"
#include "stream/stream_port.h"

namespace kvmove {

struct StreamConfig {
    double cancel_timeout_seconds = 5;  // a Cancel's answer, before the sender is disconnected
    double ack_timeout_seconds = 10;    // a Begin's answer and a Final's Ack, before the
                                        // sender's stream fails
};

// Counters of one agent's streams (since it started, unless said otherwise).
struct StreamStats {
    uint64_t leases_granted = 0;
    uint64_t leases_active = 0;       // now: granted and not yet released
    uint64_t blocks_quarantined = 0;  // now: of cancelled leases whose sender has not answered,
                                      // or was cut off and may still write (its process lives)
    uint64_t leases_quarantined = 0;  // leases whose sender was cut off while it could write
    uint64_t leases_expired = 0;      // deadlines that passed
    uint64_t cancels_sent = 0;
    uint64_t senders_disconnected = 0;  // no answer to a Cancel in time
    uint64_t messages_refused = 0;      // for no lease, another sender, or a state not allowing
                                        // it; offers beyond a peer's queue
    uint64_t begins_refused = 0;        // of those, Begins answered with Refuse
    uint64_t checksum_mismatches = 0;   // blocks (per layer) whose bytes did not match
    uint64_t acks_missed = 0;           // sender: Finals not acknowledged in time
    // Filled by the transport (Agent): messages it dropped before the protocol saw them.
    uint64_t unknown_senders = 0;   // from an endpoint that is no peer's
    uint64_t messages_dropped = 0;  // rendezvous, oversize, or over a peer's queue cap
};

class StreamProtocol {
public:
    // incarnation: this agent's, the high 32 bits of every epoch it grants.
    StreamProtocol(StreamPort& port, const KVGeometry& local, uint32_t incarnation,
                   StreamConfig config);
    ~StreamProtocol();
    StreamProtocol(const StreamProtocol&) = delete;
    StreamProtocol& operator=(const StreamProtocol&) = delete;

    // User verbs (they take the port's lock).
    std::shared_ptr<SaveStream> stream_to(const std::string& peer,
                                          const std::vector<BlockId>& local_ids,
                                          const std::vector<BlockId>& remote_ids,
                                          const std::string& request_id, uint64_t epoch,
                                          bool checksums);
    // lease_seconds: the lease's deadline from now.
    std::shared_ptr<LoadStream> expect(const std::string& peer, const std::string& request_id,
                                       const std::vector<BlockId>& local_ids, double lease_seconds);
    // The hand-off (stream_message.h): expect() and start_load(), and the lease offered to
    // peer in an Offer message. The load fails if the Offer cannot be sent.
    std::shared_ptr<LoadStream> offer(const std::string& peer, const std::string& request_id,
                                      const std::vector<BlockId>& local_ids, double lease_seconds);
    // An Offer of no blocks: "none of request_id's KV is needed here".
    void offer_nothing(const std::string& peer, const std::string& request_id);
    // Sender: the offers peers made, oldest first (offer_box.h); wait_offer: the oldest,
    // TimeoutError after timeout_seconds.
    std::vector<Offer> offers();
    Offer wait_offer(double timeout_seconds);
    // Sender: tells the offer's peer that its lease will not be written (its load fails with
    // reason, its blocks are free at once). Only before stream_to() into it.
    void decline(const Offer& offer, const std::string& reason);
    StreamStats stats() const;

    // From the streams (no lock held).
    void check_open() const;  // ConfigError once closed
    void queue_layer(std::shared_ptr<SaveStream> stream, int64_t layer, uintptr_t cuda_event);
    void queue_end(std::shared_ptr<SaveStream> stream);
    void start_load(LoadStream& load);
    void cancel_load(LoadStream& load);

    // From the port, its lock held. sender: the peer the message came from.
    void on_message(const std::string& sender, const void* data, size_t nbytes);
    // The peer's connection is gone (it died, or was removed or disconnected, its endpoint
    // closed): its streams fail; its leases are released, but those it engaged while its
    // process lives, which are quarantined.
    void peer_failed(const std::string& peer, ErrorKind kind, const std::string& reason);
    void tick(double now);         // deadlines
    double next_deadline() const;  // the earliest, on the steady clock (infinity: none)
    void drain();                  // sends what callbacks made due
    bool has_deferred() const { return !ending_.empty() || !outbox_.empty(); }
    // Locked. Streams sent from here that wait for their receiver's answer: a Begin's Go, or
    // a Final's Ack (the receiver checks the last layers). The hand-off is under way though
    // no copy of it runs: the agent's less urgent traffic keeps off meanwhile (copier.h).
    size_t answers_awaited();

    // Shutdown: stop_threads() (no lock held) joins the post and verify threads; close()
    // (locked, once the port's connections are closed) fails every open stream with reason
    // and releases every lease.
    void stop_threads();
    void close(const std::string& reason);

private:
    using SendKey = std::pair<std::string, uint64_t>;  // (receiver, epoch)
    // A saved layer (or the end of a stream) for the post thread, after its CUDA event.
    struct Pending {
        enum class Kind { Layer, End };
        Kind kind = Kind::Layer;
        std::shared_ptr<SaveStream> stream;
        int64_t layer = 0;
        uintptr_t event = 0;
    };
    struct Sending {
        std::shared_ptr<SaveStream> stream;
        double deadline;          // of the Begin's answer, then (once its Final is out) of the Ack
        bool begin_sent = false;  // the Begin's send completed here (for the timeout's message)
    };
    struct Lease {
        enum class Phase { Granted, Engaged, Cancelling };
        std::shared_ptr<LoadStream> load;
        Phase phase = Phase::Granted;
        double deadline;         // of the lease
        double cancel_deadline;  // of the Cancel's answer, while Cancelling
    };
    // A lease whose sender was cut off while it could still write: its blocks stay out of use
    // until the sender's process exited.
    struct Quarantined {
        std::shared_ptr<LoadStream> load;
        std::shared_ptr<const ProcessWatch> sender;  // null: not watchable
        uint32_t incarnation;  // the sender's run: only that run's Abort ends it
        double next_cancel;    // when it is asked again, while that run is a live peer
    };
    // A received layer whose checksums the verify thread checks.
    struct Verify {
        std::shared_ptr<LoadStream> load;
        int64_t layer;
        std::vector<uint64_t> checksums;
    };

    // sender
    void queue(Pending pending);
    bool try_queue(Pending pending);
    void post_loop();
    // checksums: the layer's, computed by the post thread; none while s has checksums: the
    // port computes them with its puts.
    void post_layer(const std::shared_ptr<SaveStream>& s, int64_t layer,
                    std::optional<std::vector<uint64_t>> checksums);
    void layer_result(const std::shared_ptr<SaveStream>& s, int64_t layer,
                      const PortOutcome& outcome);
    void send_end(const std::shared_ptr<SaveStream>& s);
    void end_sent(const std::shared_ptr<SaveStream>& s, const PortOutcome& outcome);
    void forget(const SaveStream& s);
    void on_go(const std::string& sender, const StreamMessage& m);
    void on_refuse(const std::string& sender, const StreamMessage& m);
    void on_ack(const std::string& sender, const StreamMessage& m);
    void on_cancel(const std::string& sender, const StreamMessage& m);
    void on_offer(const std::string& sender, const StreamMessage& m);
    void answer_cancel_when_quiet(const std::string& sender, const StreamMessage& m);
    void send_held_aborts();
    // receiver
    std::shared_ptr<LoadStream> grant(const std::string& peer, const std::string& request_id,
                                      const std::vector<BlockId>& local_ids, double lease_seconds);
    void on_decline(Lease& lease, const StreamMessage& m);
    Lease* lease_of(const std::string& sender, const StreamMessage& m);
    void on_begin(const std::string& sender, const StreamMessage& m);
    void on_layer(Lease& lease, const StreamMessage& m);
    void on_final(Lease& lease, const StreamMessage& m);
    void end_lease(Lease& lease, StreamState state, ErrorKind kind, const std::string& error);
    void release(uint64_t epoch);
    void end_quarantines();
    void cancel_quarantined(double now);
    bool on_quarantined_abort(const std::string& sender, const StreamMessage& m);
    void verify_loop();
    // both
    std::vector<uint64_t> checksums_of(const std::vector<BlockId>& ids, int64_t layer,
                                       uint64_t epoch) const;
    void post_message(const std::string& peer, StreamMessage message);
    void refuse(const std::string& sender, const StreamMessage& m, const std::string& why);

    StreamPort& port_;
    const KVGeometry& local_;
    const uint32_t incarnation_;
    const StreamConfig config_;
    std::atomic<bool> closed_{false};

    // Guarded by the port's lock.
    uint64_t next_epoch_;
    std::map<SendKey, Sending> sending_;  // open streams by (receiver, epoch)
    bool sending_changed_ = false;        // since answers_awaited() counted them
    size_t answers_awaited_ = 0;
    std::vector<std::shared_ptr<SaveStream>> ending_;            // Final/Abort due, sent by drain()
    std::map<uint64_t, Lease> leases_;                           // by epoch
    std::map<uint64_t, Quarantined> quarantined_;                // by epoch
    double next_quarantine_check_ = 0;                           // tick(): its senders polled then
    std::vector<std::pair<std::string, StreamMessage>> outbox_;  // sent by drain()
    // Aborts that answer a Cancel for a lease with nothing in flight here, held until the
    // peer's old connection has no copy left (StreamPort::peer_quiet).
    std::vector<std::pair<std::string, StreamMessage>> held_aborts_;
    StreamStats stats_;
    std::atomic<uint64_t> checksum_mismatches_{0};  // counted by the verify thread
    OfferBox offers_{kMaxQueuedOffers};  // its own mutex: waited on without the port's lock

    // save_layer() only queues: the post thread posts each layer (after its CUDA event, if
    // any). Over tcp and shared memory a put copies its bytes inside ucp_put_nbx, which would
    // stall the forward pass calling save_layer() for the whole layer's transfer.
    std::mutex post_mu_;
    std::condition_variable post_cv_;
    std::deque<Pending> to_post_;
    bool post_stop_ = false;  // guarded by post_mu_
    std::thread post_thread_;

    std::mutex verify_mu_;
    std::condition_variable verify_cv_;
    std::deque<Verify> to_verify_;
    bool verify_stop_ = false;  // guarded by verify_mu_
    std::thread verify_thread_;

    // Where the post and verify threads run: the CPUs of the thread that built this (the
    // agent's), not those of the first save_layer's caller (common/cpu_mask.h).
    CpuMask threads_cpus_ = CpuMask::of_this_thread();
};

}  // namespace kvmove
