// Layer streams: one request's KV sent layer by layer as the forward pass computes it.
//
// SaveStream (prefill side): save_layer(i) posts layer i's coalesced puts into the blocks
// the receiver reserved, then a flush, then a Layer message; finish(payload) sends the Final
// message once every layer has landed, and the stream is DONE when the receiver acknowledges
// it. abort() stops it: once the layers already posted have landed (so no late write can hit
// blocks the receiver then frees), an Abort message goes out and the stream is ABORTED.
//
// LoadStream (decode side): wait_for_layer(i) returns once the Layer message for i arrived,
// which the sender only sends after the flush that completed layer i's puts, so the bytes are
// there; wait_all() once the Final did. An Abort, the sender's death or the agent closing
// wakes every waiter with an exception.
//
// The protocol runs in StreamProtocol (stream_protocol.h) under its port's lock; the classes
// here hold each stream's user-facing state and the condition its waiters block on, behind
// their own mutex, which only they touch. The protocol calls the methods marked "protocol".
// Messages: stream_message.h.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/kv_geometry.h"

namespace kvmove {

class StreamProtocol;

enum class StreamState { Open, Done, Aborted, Failed };

// How a sender's stream is to end, once its saved layers have landed.
enum class StreamEnd { None, Finish, Abort };

// When a layer was posted (sender) and when it landed (both sides), in seconds on the steady
// clock (CLOCK_MONOTONIC, the clock of Python's time.monotonic()); NaN until it happens.
struct LayerTiming {
    double posted;
    double landed;
};

double steady_seconds();

// The state and waiting both stream kinds share: a terminal state set once, first one wins.
class StreamCompletion {
public:
    explicit StreamCompletion(int64_t num_layers);
    StreamState state() const;
    std::string error() const;
    std::vector<LayerTiming> layer_times() const;
    // Returns false when the state was already terminal.
    bool complete(StreamState state, ErrorKind kind = ErrorKind::Transfer, std::string error = "");

protected:
    bool set_state_locked(StreamState state, ErrorKind kind, std::string error);  // mu_ held

    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    StreamState state_ = StreamState::Open;
    ErrorKind error_kind_ = ErrorKind::Transfer;
    std::string error_;
    std::vector<LayerTiming> times_;
};

class SaveStream : public StreamCompletion, public std::enable_shared_from_this<SaveStream> {
public:
    SaveStream(StreamProtocol* protocol, std::string peer, std::vector<BlockId> local_ids,
               std::vector<BlockId> remote_ids, std::string request_id, int64_t num_layers,
               uint64_t serial);

    const std::string& peer() const { return peer_; }
    const std::string& request_id() const { return request_id_; }
    int64_t num_layers() const { return num_layers_; }
    int64_t num_blocks() const { return static_cast<int64_t>(local_ids_.size()); }
    const std::vector<BlockId>& local_ids() const { return local_ids_; }
    const std::vector<BlockId>& remote_ids() const { return remote_ids_; }
    uint64_t ids_hash() const { return ids_hash_; }
    uint64_t serial() const { return serial_; }

    // cuda_event: 0 for none, else a cudaEvent_t the core waits for before posting (CUDA
    // builds only).
    void save_layer(int64_t layer, uintptr_t cuda_event);
    void finish(const std::string& payload);
    void abort();
    // Returns DONE or ABORTED; throws the failure once FAILED, TimeoutError at the deadline.
    StreamState wait(double timeout_seconds) const;

    // Protocol: layer was posted now.
    void record_posted(int64_t layer);
    // Protocol: a saved layer landed (ok) or failed; true when the Final/Abort is now due.
    bool layer_done(int64_t layer, bool ok, ErrorKind kind, const std::string& error);
    // Protocol: how the stream is to end, and the Final's payload.
    StreamEnd end() const;
    std::string payload() const;

private:
    bool close_due_locked();  // mu_ held; true once, when closing and nothing is in flight
    std::string describe() const;
    [[noreturn]] void raise_failure_locked() const;

    StreamProtocol* const protocol_;
    const std::string peer_;
    const std::vector<BlockId> local_ids_;
    const std::vector<BlockId> remote_ids_;
    const std::string request_id_;
    const int64_t num_layers_;
    const uint64_t ids_hash_;
    const uint64_t serial_;

    // Guarded by mu_: save_layer(), finish() and abort() never wait for the agent's worker.
    std::vector<char> saved_;
    int64_t num_saved_ = 0;
    int64_t unlanded_ = 0;  // saved, neither landed nor failed yet
    StreamEnd end_ = StreamEnd::None;
    bool close_sent_ = false;
    std::string payload_;
};

class LoadStream : public StreamCompletion, public std::enable_shared_from_this<LoadStream> {
public:
    LoadStream(StreamProtocol* protocol, std::string peer, std::string request_id,
               std::vector<BlockId> local_ids, int64_t num_layers);

    const std::string& peer() const { return peer_; }
    const std::string& request_id() const { return request_id_; }
    const std::vector<BlockId>& local_ids() const { return local_ids_; }
    int64_t num_layers() const { return num_layers_; }
    uint64_t ids_hash() const { return ids_hash_; }

    void start_load();
    // Stops expecting the request. The sender is not told: its puts may still land in the
    // blocks until it finishes or aborts.
    void cancel();
    void wait_for_layer(int64_t layer, double timeout_seconds) const;
    std::string wait_all(double timeout_seconds) const;  // returns the Final's payload
    std::vector<bool> layers_ready() const;
    std::string payload() const;

    // Protocol: throws ConfigError unless start_load() may run (not yet started, not
    // cancelled); mark_started() then records that it did.
    void check_startable() const;
    void mark_started();
    // Protocol: applies one message; returns true when it made the stream terminal.
    bool apply(int32_t layer, bool final, const std::string& payload);

private:
    void raise_if_ended() const;  // with mu_ held

    StreamProtocol* const protocol_;
    const std::string peer_;
    const std::string request_id_;
    const std::vector<BlockId> local_ids_;
    const int64_t num_layers_;
    const uint64_t ids_hash_;

    // Guarded by mu_.
    bool started_ = false;
    std::vector<bool> ready_;
    int64_t num_ready_ = 0;
    bool final_ = false;
    std::string payload_;
};

}  // namespace kvmove
