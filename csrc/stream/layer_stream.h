// Layer streams: one request's KV sent layer by layer as the forward pass computes it, into
// blocks the receiver leased for it.
//
// LoadStream (receiver): Agent::expect() leases its blocks: an epoch (never reused by this
// agent) and a deadline. The receiver tells the sender the epoch and the block ids (its control
// plane: a router, vLLM's kv_transfer_params). wait_for_layer(i) returns once layer i's bytes
// are there (and, with checksums, verified); wait_all() once every layer and the Final did.
// released() says when no byte of the stream can land in the blocks any more: only then may
// they be reused (see stream_protocol.h for when that is).
//
// SaveStream (sender): Agent::stream_to(..., epoch) asks the receiver for the lease (Begin)
// and posts nothing before its Go. save_layer(i) then posts layer i's coalesced puts into the
// leased blocks, a flush, and a Layer message; finish(payload) sends the Final once every layer
// landed, and the stream is DONE when the receiver acknowledges it. abort() stops it: once the
// layers already posted have landed, an Abort goes out and the stream is ABORTED. A receiver's
// Cancel does the same.
//
// The protocol runs in StreamProtocol (stream_protocol.h) under its port's lock; the classes
// here hold each stream's own state and the condition its waiters block on, behind a mutex
// only they touch. The protocol calls the methods marked "protocol". Messages:
// stream_message.h.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/completion.h"
#include "common/errors.h"
#include "common/kv_geometry.h"

namespace kvmove {

class StreamProtocol;

enum class StreamState { Open, Done, Aborted, Failed };

// How a sender's stream is to end, once its posted layers have landed.
enum class StreamEnd { None, Finish, Abort };

// When a layer was posted (sender) and when it landed (both sides), in seconds on the steady
// clock (CLOCK_MONOTONIC, the clock of Python's time.monotonic()); NaN until it happens.
struct LayerTiming {
    double posted;
    double landed;
};

double steady_seconds();

// The seed of block i's checksum in a layer of a stream: the checksum binds the bytes to their
// lease, layer and place, so a block that holds another's (intact) bytes fails too.
uint64_t checksum_seed(uint64_t epoch, int64_t layer, size_t index);

// The state and waiting both stream kinds share (common/completion.h), and the layers' times.
class StreamCompletion : public Completion<StreamState, StreamState::Open> {
public:
    explicit StreamCompletion(int64_t num_layers);
    std::vector<LayerTiming> layer_times() const;

protected:
    std::vector<LayerTiming> times_;
};

// A saved layer, and the CUDA event to wait for before posting it (0: none).
struct SavedLayer {
    int64_t layer;
    uintptr_t event;
};

class SaveStream : public StreamCompletion, public std::enable_shared_from_this<SaveStream> {
public:
    SaveStream(StreamProtocol* protocol, std::string peer, std::vector<BlockId> local_ids,
               std::vector<BlockId> remote_ids, std::string request_id, int64_t num_layers,
               uint64_t epoch, bool checksums);

    const std::string& peer() const { return peer_; }
    const std::string& request_id() const { return request_id_; }
    int64_t num_layers() const { return num_layers_; }
    int64_t num_blocks() const { return static_cast<int64_t>(local_ids_.size()); }
    const std::vector<BlockId>& local_ids() const { return local_ids_; }
    const std::vector<BlockId>& remote_ids() const { return remote_ids_; }
    uint64_t ids_hash() const { return ids_hash_; }
    uint64_t epoch() const { return epoch_; }
    bool checksums() const { return checksums_; }

    // cuda_event: 0 for none, else a cudaEvent_t the core waits for before posting (CUDA
    // builds only).
    void save_layer(int64_t layer, uintptr_t cuda_event);
    void finish(const std::string& payload);
    void abort();
    // Returns DONE or ABORTED; throws the failure once FAILED, TimeoutError at the deadline.
    StreamState wait(double timeout_seconds) const;
    // The receiver answered the Begin (Go) or refused it; false while waiting.
    bool answered() const;

    // Protocol: the receiver said Go; returns the layers saved meanwhile, to post in order.
    std::vector<SavedLayer> go();
    // Protocol: the receiver refused the lease: FAILED, nothing was posted.
    void refused(const std::string& reason);
    // Protocol: the receiver cancelled; true when the Abort is now due.
    bool cancelled();
    bool was_cancelled() const;
    // Protocol: layer was posted now.
    void record_posted(int64_t layer);
    // Protocol: a posted layer landed (ok) or failed; true when the Final/Abort is now due.
    bool layer_done(int64_t layer, bool ok, ErrorKind kind, const std::string& error);
    // Protocol: how the stream is to end, and the Final's payload.
    StreamEnd end() const;
    std::string payload() const;

private:
    enum class Phase { Waiting, Go, Refused };
    bool close_due_locked();  // mu_ held; true once, when ending and nothing is in flight
    std::string describe() const;
    [[noreturn]] void raise_failure_locked() const;

    StreamProtocol* const protocol_;
    const std::string peer_;
    const std::vector<BlockId> local_ids_;
    const std::vector<BlockId> remote_ids_;
    const std::string request_id_;
    const int64_t num_layers_;
    const uint64_t ids_hash_;
    const uint64_t epoch_;
    const bool checksums_;

    // Guarded by mu_: save_layer(), finish() and abort() never wait for the agent's worker.
    Phase phase_ = Phase::Waiting;
    std::vector<SavedLayer> held_;  // saved before the Go
    std::vector<char> saved_;
    int64_t num_saved_ = 0;
    int64_t in_flight_ = 0;  // handed to the post thread, neither landed nor failed yet
    StreamEnd end_ = StreamEnd::None;
    bool cancelled_ = false;  // by the receiver
    bool close_sent_ = false;
    std::string payload_;
};

class LoadStream : public StreamCompletion, public std::enable_shared_from_this<LoadStream> {
public:
    LoadStream(StreamProtocol* protocol, std::string peer, std::string request_id,
               std::vector<BlockId> local_ids, int64_t num_layers, uint64_t epoch);

    const std::string& peer() const { return peer_; }
    const std::string& request_id() const { return request_id_; }
    const std::vector<BlockId>& local_ids() const { return local_ids_; }
    int64_t num_layers() const { return num_layers_; }
    uint64_t ids_hash() const { return ids_hash_; }
    uint64_t epoch() const { return epoch_; }

    void start_load();
    // Cancels the lease: waiters get TransferError at once; the blocks are released once the
    // sender stopped (see released()).
    void cancel();
    void wait_for_layer(int64_t layer, double timeout_seconds) const;
    std::string wait_all(double timeout_seconds) const;  // returns the Final's payload
    std::vector<bool> layers_ready() const;
    int64_t num_layers_landed() const;  // layers whose message arrived (checked or not)
    std::string payload() const;
    // True once no byte of this stream can land in the blocks any more.
    bool released() const;
    // Returns true once released, false when timeout_seconds pass first.
    bool wait_released(double timeout_seconds) const;
    // Blocks (ids) whose bytes did not match the sender's checksums, in any layer.
    std::vector<BlockId> bad_blocks() const;

    // Protocol: throws ConfigError unless start_load() may run (not yet started, not failed
    // or cancelled); mark_started() then records that it did.
    void check_startable() const;
    void mark_started();
    // Protocol: layer `layer` landed; `verified` when it needs no checksum check (else
    // layer_verified follows). Returns true when it made the stream terminal.
    bool layer_landed(int64_t layer, bool verified);
    // Protocol: the checksum check of a layer is done; bad: indexes into local_ids.
    bool layer_verified(int64_t layer, const std::vector<size_t>& bad);
    // Protocol: the Final arrived with payload.
    bool final_arrived(const std::string& payload);
    // Protocol: no byte can land any more. Called before the end it comes with, so a waiter
    // woken by that end already sees the blocks released.
    void set_released();

private:
    bool done_locked() const;      // every layer in and verified, and the Final
    void raise_if_ended() const;   // with mu_ held
    bool finish_if_done_locked();  // sets DONE (or FAILED on bad blocks); mu_ held

    StreamProtocol* const protocol_;
    const std::string peer_;
    const std::string request_id_;
    const std::vector<BlockId> local_ids_;
    const int64_t num_layers_;
    const uint64_t ids_hash_;
    const uint64_t epoch_;

    // Guarded by mu_.
    bool started_ = false;
    std::vector<char> landed_;
    std::vector<char> ready_;  // landed and verified
    int64_t num_ready_ = 0;
    bool final_ = false;
    std::string payload_;
    std::vector<char> bad_;  // per block, any layer
    bool released_ = false;
};

}  // namespace kvmove
