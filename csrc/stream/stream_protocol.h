// StreamProtocol: the layer-stream protocol of layer_stream.h, over any StreamPort.
//
// Sender: stream_to() opens a SaveStream; each save_layer() queues the layer for the post
// thread, which asks the port to put it and then send its Layer message; once every saved
// layer landed and finish() or abort() was called, the Final (acknowledged by the receiver)
// or the Abort goes out. Receiver: expect() makes a LoadStream; start_load() binds it to the
// sender's stream (messages that came first wait in `unclaimed_` for a while) and each message
// is applied to it. A cancelled load drops the rest of its stream, so that a later load of the
// same request id only ever sees a new stream.
//
// Locking: the protocol's state is guarded by the port's lock (stream_port.h): the user verbs
// take it through run_locked(), the port holds it when it calls on_message(), peer_failed(),
// drain() and the PortDone callbacks. Lock order: the port's lock, then a stream's own mutex.
// The post queue has its own mutex, never held while taking the port's lock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "stream/layer_stream.h"
#include "stream/stream_message.h"
#include "stream/stream_port.h"

namespace kvmove {

class StreamProtocol {
public:
    StreamProtocol(StreamPort& port, const KVGeometry& local);
    ~StreamProtocol();
    StreamProtocol(const StreamProtocol&) = delete;
    StreamProtocol& operator=(const StreamProtocol&) = delete;

    // User verbs (they take the port's lock).
    std::shared_ptr<SaveStream> stream_to(const std::string& peer,
                                          const std::vector<BlockId>& local_ids,
                                          const std::vector<BlockId>& remote_ids,
                                          const std::string& request_id);
    std::shared_ptr<LoadStream> expect(const std::string& peer, const std::string& request_id,
                                       const std::vector<BlockId>& local_ids);

    // From the streams (no lock held).
    void check_open() const;  // ConfigError once closed
    void queue_layer(std::shared_ptr<SaveStream> stream, int64_t layer, uintptr_t cuda_event);
    void queue_end(std::shared_ptr<SaveStream> stream);
    void start_load(LoadStream& load);
    void cancel_load(LoadStream& load);

    // From the port, its lock held.
    void on_message(const std::string& sender, const void* data, size_t nbytes,
                    ReplyHandle reply_to);
    void peer_failed(const std::string& peer, ErrorKind kind, const std::string& reason);
    void drain();  // sends what callbacks made due
    bool has_deferred() const { return !ending_.empty(); }

    // Shutdown: stop_posting() (no lock held) joins the post thread; close() (locked) fails
    // every open stream with reason.
    void stop_posting();
    void close(const std::string& reason);

private:
    using StreamKey = std::pair<std::string, std::string>;  // (peer, request id)
    // A saved layer (or the end of a stream) for the post thread, after its CUDA event.
    struct Pending {
        enum class Kind { Layer, End };
        Kind kind = Kind::Layer;
        std::shared_ptr<SaveStream> stream;
        int64_t layer = 0;
        uintptr_t event = 0;
    };
    // A started load and the sender stream it takes messages from.
    struct Loading {
        std::shared_ptr<LoadStream> load;
        bool bound = false;  // serial is known (the first message bound it)
        uint64_t serial = 0;
    };
    // A message that came before its load's start_load().
    struct Unclaimed {
        double arrived;
        std::string sender;
        StreamMessage message;
    };
    // The rest of a stream whose load was cancelled or failed: dropped until it ends.
    struct Dropped {
        double since;
        bool bound;  // serial is known (else: the next stream of the key to arrive)
        uint64_t serial;
    };

    void queue(Pending pending);
    void post_loop();
    void post(const Pending& pending, const std::string& cuda_error);
    void post_layer(const std::shared_ptr<SaveStream>& s, int64_t layer);
    void layer_result(const std::shared_ptr<SaveStream>& s, int64_t layer,
                      const PortOutcome& outcome);
    void send_end(const std::shared_ptr<SaveStream>& s);
    void end_sent(const std::shared_ptr<SaveStream>& s, const PortOutcome& outcome);
    void forget(const SaveStream& s);
    void deliver(Loading& loading, const StreamMessage& m);
    void unregister(const LoadStream& load);
    void drop_rest(const LoadStream& load, bool bound, uint64_t serial);
    void on_ack(const std::string& sender, const StreamMessage& m);
    bool drop_if_cancelled(const StreamKey& key, const StreamMessage& m);
    void keep_unclaimed(const std::string& sender, const StreamMessage& m);

    StreamPort& port_;
    const KVGeometry& local_;
    std::atomic<bool> closed_{false};
    std::atomic<uint64_t> next_serial_;  // streams sent, from a random start

    // Guarded by the port's lock.
    std::map<StreamKey, std::shared_ptr<SaveStream>> sending_;  // open streams by receiver
    std::vector<std::shared_ptr<SaveStream>> ending_;           // Final/Abort due, sent by drain()
    std::map<StreamKey, Loading> loading_;                      // started loads by sender
    std::deque<Unclaimed> unclaimed_;
    std::map<StreamKey, Dropped> dropped_;

    // save_layer() only queues: the post thread posts each layer (after its CUDA event, if
    // any). Over tcp and shared memory a put copies its bytes inside ucp_put_nbx, which would
    // stall the forward pass calling save_layer() for the whole layer's transfer.
    std::mutex post_mu_;
    std::condition_variable post_cv_;
    std::deque<Pending> to_post_;
    bool post_stop_ = false;  // guarded by post_mu_
    std::thread post_thread_;
};

}  // namespace kvmove
