// StreamPort: what the layer-stream protocol needs from a transport, and nothing more.
//
// The Agent implements it over UCX (transport/agent.h); the protocol (stream_protocol.h) never
// sees UCX. It asks the port to put one layer of a stream's blocks and then send a message, to
// send a message, or to cut a peer off, and learns how each ended from a callback.
//
// Serialization: the protocol's state is guarded by the port's lock. run_locked() is how a
// caller (a user verb, the protocol's post thread) takes it; the port calls into the protocol
// (StreamProtocol::on_message, ::peer_failed, ::tick, ::drain, and every PortDone) with it
// held. on_message and PortDone callbacks may run inside the transport's own callbacks, where
// nothing may be sent: the protocol queues what they make due and sends it from drain().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/kv_geometry.h"

namespace kvmove {

// Whether a peer's process has exited (transport/process_watch.h watches one with a pidfd).
class ProcessWatch {
public:
    virtual ~ProcessWatch() = default;
    virtual bool exited() const = 0;
};

// How a posted operation ended. kind is Peer when the peer is gone (dead, removed, closing).
struct PortOutcome {
    bool ok = true;
    ErrorKind kind = ErrorKind::Transfer;
    std::string error;
};
using PortDone = std::function<void(const PortOutcome&)>;

// A layer's per-block checksums, computed by the port with its puts (put_then_send).
struct PutChecksums {
    std::vector<uint64_t> seeds;
    std::vector<uint64_t> values;  // as many as seeds, filled before the message is built
};

class StreamPort {
public:
    virtual ~StreamPort() = default;

    virtual const std::string& local_name() const = 0;
    // Seconds the post thread waits (off the lock) before posting a layer: 0 but under fault
    // injection (transport/faults.h).
    virtual double post_delay_seconds() { return 0; }
    // Runs fn with the port's lock held (and sends what fn made due before releasing it).
    virtual void run_locked(const std::function<void()>& fn) = 0;

    // Locked. Throws (PeerError, ConfigError, BlockError) unless local_ids[i] -> remote_ids[i]
    // may be put to peer: a live peer of the same layout, ids in range, no destination twice.
    virtual void check_put(const std::string& peer, const std::vector<BlockId>& local_ids,
                           const std::vector<BlockId>& remote_ids) const = 0;
    // Locked. Throws unless peer is a live peer of the same layout.
    virtual void check_sender(const std::string& peer) const = 0;
    virtual bool peer_alive(const std::string& peer) const = 0;  // locked
    // Locked. The incarnation the peer's metadata announced (the high 32 bits of its epochs).
    virtual uint32_t peer_incarnation(const std::string& peer) const = 0;

    // Locked. Puts layer `layer` of local_ids[i] -> remote_ids[i] (into the peer's lease
    // `lease`), flushes them, then sends message(); done(ok) once the message is out,
    // done(failure) when anything failed. With sums, the port also computes block i's
    // checksum in the layer (memory/block_checksum.h, seeded with sums->seeds[i]) into
    // sums->values[i] before message() is called: as it copies, where the peer's path
    // checksums_on_copy().
    virtual void put_then_send(const std::string& peer, const std::vector<BlockId>& local_ids,
                               const std::vector<BlockId>& remote_ids, int64_t layer,
                               uint64_t lease, std::function<std::string()> message, PortDone done,
                               std::shared_ptr<PutChecksums> sums) = 0;
    // Locked. Whether puts to peer compute their checksums as they copy (cheaper than the
    // caller reading the blocks once more beforehand).
    virtual bool checksums_on_copy(const std::string& peer) const = 0;
    // Locked. The receiver cancelled `lease` of peer: its layers not yet under way are
    // dropped (their put_then_send fails). Safe inside the transport's callbacks.
    virtual void cancel_puts(const std::string& peer, uint64_t lease) = 0;
    // Locked. False while a connection of peer's that was closed still has copies under way
    // (a mapped path's copy threads finish the chunk they are on): what was posted there may
    // still land.
    virtual bool peer_quiet(const std::string& peer) const = 0;
    // Locked. The incarnation of the peer's metadata, failed or not (0: no such peer).
    virtual uint32_t peer_run(const std::string& peer) const = 0;
    // Locked. The peer's process, where this host can watch it (ProcessWatch; null: another
    // host or pid namespace, or not a peer).
    virtual std::shared_ptr<const ProcessWatch> peer_process(const std::string& peer) const = 0;
    // Locked. Sends message to peer, after what was sent to it before.
    virtual void send(const std::string& peer, std::string message, PortDone done) = 0;
    // Locked, outside the transport's callbacks. Closes the connection to peer at once (its
    // operations cancelled): once this returns, nothing the peer posts reaches this process.
    // Then calls StreamProtocol::peer_failed(peer, ...).
    virtual void disconnect(const std::string& peer, const std::string& reason) = 0;
};

}  // namespace kvmove
