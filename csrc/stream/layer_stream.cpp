#include "stream/layer_stream.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "cuda/cuda_event.h"
#include "stream/stream_message.h"
#include "stream/stream_protocol.h"

namespace kvmove {

namespace {

constexpr double kNever = std::numeric_limits<double>::quiet_NaN();

std::chrono::duration<double> seconds(double s) {
    return std::chrono::duration<double>(s);
}

}  // namespace

double steady_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

StreamCompletion::StreamCompletion(int64_t num_layers)
    : times_(static_cast<size_t>(num_layers), LayerTiming{kNever, kNever}) {}

StreamState StreamCompletion::state() const {
    std::lock_guard<std::mutex> lock(mu_);
    return state_;
}

std::string StreamCompletion::error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
}

std::vector<LayerTiming> StreamCompletion::layer_times() const {
    std::lock_guard<std::mutex> lock(mu_);
    return times_;
}

bool StreamCompletion::set_state_locked(StreamState state, ErrorKind kind, std::string error) {
    if (state_ != StreamState::Open) {
        return false;
    }
    state_ = state;
    error_kind_ = kind;
    error_ = std::move(error);
    return true;
}

bool StreamCompletion::complete(StreamState state, ErrorKind kind, std::string error) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!set_state_locked(state, kind, std::move(error))) {
            return false;
        }
    }
    cv_.notify_all();
    return true;
}

SaveStream::SaveStream(StreamProtocol* protocol, std::string peer, std::vector<BlockId> local_ids,
                       std::vector<BlockId> remote_ids, std::string request_id, int64_t num_layers,
                       uint64_t serial)
    : StreamCompletion(num_layers),
      protocol_(protocol),
      peer_(std::move(peer)),
      local_ids_(std::move(local_ids)),
      remote_ids_(std::move(remote_ids)),
      request_id_(std::move(request_id)),
      num_layers_(num_layers),
      ids_hash_(hash_ids(remote_ids_)),
      serial_(serial),
      saved_(static_cast<size_t>(num_layers), 0) {}

std::string SaveStream::describe() const {
    return "request '" + request_id_ + "' with '" + peer_ + "'";
}

void SaveStream::raise_failure_locked() const {
    throw Error(error_kind_, error_);
}

void SaveStream::save_layer(int64_t layer, uintptr_t cuda_event) {
    protocol_->check_open();
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ == StreamState::Failed) {
            raise_failure_locked();
        }
        KVMOVE_CHECK(end_ == StreamEnd::None, Config,
                     "cannot save layer " << layer << " of " << describe() << " after "
                                          << (end_ == StreamEnd::Abort ? "abort()" : "finish()"));
        KVMOVE_CHECK(
            layer >= 0 && layer < num_layers_, Config,
            "layer " << layer << " is out of range: layers are in [0, " << num_layers_ << ")");
        KVMOVE_CHECK(!saved_[layer], Config,
                     "layer " << layer << " of " << describe()
                              << " was already saved: each layer is saved once");
        KVMOVE_CHECK(cuda_event == 0 || cuda_events_supported(), Cuda,
                     "save_layer() got CUDA event 0x" << std::hex << cuda_event << std::dec
                                                      << ", but kvmove was built without CUDA "
                                                         "(rebuild with KVMOVE_CUDA=1)");
        saved_[layer] = 1;
        ++num_saved_;
        ++unlanded_;
    }
    protocol_->queue_layer(shared_from_this(), layer, cuda_event);
}

void SaveStream::finish(const std::string& payload) {
    protocol_->check_open();
    KVMOVE_CHECK(
        payload.size() <= kMaxPayloadBytes, Config,
        "payload of " << payload.size() << " bytes exceeds the limit of " << kMaxPayloadBytes);
    bool due = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ == StreamState::Failed) {
            raise_failure_locked();
        }
        KVMOVE_CHECK(
            end_ == StreamEnd::None, Config,
            describe() << " was already " << (end_ == StreamEnd::Abort ? "aborted" : "finished"));
        if (num_saved_ < num_layers_) {
            std::ostringstream missing;
            int shown = 0;
            for (int64_t l = 0; l < num_layers_ && shown < 8; ++l) {
                if (!saved_[l]) {
                    missing << (shown++ ? ", " : "") << l;
                }
            }
            int64_t count = num_layers_ - num_saved_;
            KVMOVE_FAIL(Config, "cannot finish " << describe() << ": " << count
                                                 << " layers were never saved (" << missing.str()
                                                 << (count > 8 ? ", ..." : "") << ")");
        }
        end_ = StreamEnd::Finish;
        payload_ = payload;
        due = close_due_locked();
    }
    if (due) {
        protocol_->queue_end(shared_from_this());
    }
}

void SaveStream::abort() {
    bool due = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ != StreamState::Open || close_sent_) {
            return;  // nothing to stop: ended, or the Final is already on its way
        }
        end_ = StreamEnd::Abort;
        due = close_due_locked();
    }
    if (due) {
        try {
            protocol_->queue_end(shared_from_this());
        } catch (const Error&) {
            // The agent is closing: it fails every open stream, and no byte moves any more.
        }
    }
}

bool SaveStream::close_due_locked() {
    if (end_ == StreamEnd::None || close_sent_ || unlanded_ > 0) {
        return false;
    }
    close_sent_ = true;
    return true;
}

bool SaveStream::layer_done(int64_t layer, bool ok, ErrorKind kind, const std::string& error) {
    bool due = false;
    bool failed = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        --unlanded_;
        if (ok) {
            times_[layer].landed = steady_seconds();
        } else {
            failed = set_state_locked(StreamState::Failed, kind,
                                      "stream of " + describe() + " failed at layer " +
                                          std::to_string(layer) + ": " + error);
            if (end_ == StreamEnd::None) {
                end_ = StreamEnd::Abort;  // tell the receiver, if it is still there
            }
        }
        due = close_due_locked();
    }
    if (failed) {
        cv_.notify_all();
    }
    return due;
}

StreamEnd SaveStream::end() const {
    std::lock_guard<std::mutex> lock(mu_);
    return end_;
}

std::string SaveStream::payload() const {
    std::lock_guard<std::mutex> lock(mu_);
    return payload_;
}

StreamState SaveStream::wait(double timeout_seconds) const {
    check_timeout(timeout_seconds);
    std::unique_lock<std::mutex> lock(mu_);
    bool ended = cv_.wait_for(lock, seconds(timeout_seconds),
                              [this] { return state_ != StreamState::Open; });
    if (!ended) {
        int64_t landed = 0;
        for (const LayerTiming& t : times_) {
            landed += std::isnan(t.landed) ? 0 : 1;
        }
        KVMOVE_FAIL(Timeout, "stream of request '" << request_id_ << "' to '" << peer_
                                                   << "' still open after " << timeout_seconds
                                                   << " s (" << landed << " of " << num_layers_
                                                   << " layers landed)");
    }
    if (state_ == StreamState::Failed) {
        throw Error(error_kind_, error_);
    }
    return state_;
}

void SaveStream::record_posted(int64_t layer) {
    std::lock_guard<std::mutex> lock(mu_);
    times_[layer].posted = steady_seconds();
}

LoadStream::LoadStream(StreamProtocol* protocol, std::string peer, std::string request_id,
                       std::vector<BlockId> local_ids, int64_t num_layers)
    : StreamCompletion(num_layers),
      protocol_(protocol),
      peer_(std::move(peer)),
      request_id_(std::move(request_id)),
      local_ids_(std::move(local_ids)),
      num_layers_(num_layers),
      ids_hash_(hash_ids(local_ids_)),
      ready_(static_cast<size_t>(num_layers), false) {}

void LoadStream::start_load() {
    protocol_->start_load(*this);
}

void LoadStream::cancel() {
    protocol_->cancel_load(*this);
}

void LoadStream::check_startable() const {
    std::lock_guard<std::mutex> lock(mu_);
    KVMOVE_CHECK(!started_ && state_ == StreamState::Open, Config,
                 "start_load() of request '"
                     << request_id_ << "' with '" << peer_ << "'"
                     << (started_ ? " was already called" : " after cancel()"));
}

void LoadStream::mark_started() {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = true;
}

bool LoadStream::apply(int32_t layer, bool final, const std::string& payload) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ != StreamState::Open) {
            return false;
        }
        if (final) {
            final_ = true;
            payload_ = payload;
        } else if (!ready_[layer]) {
            ready_[layer] = true;
            times_[layer].landed = steady_seconds();
            ++num_ready_;
        }
        if (!final_ || num_ready_ < num_layers_) {
            cv_.notify_all();
            return false;
        }
    }
    return complete(StreamState::Done);
}

void LoadStream::raise_if_ended() const {
    if (state_ == StreamState::Aborted) {
        KVMOVE_FAIL(Transfer,
                    "request '" << request_id_ << "' was aborted by its sender '" << peer_ << "'");
    }
    if (state_ == StreamState::Failed) {
        throw Error(error_kind_, error_);
    }
}

void LoadStream::wait_for_layer(int64_t layer, double timeout_seconds) const {
    check_timeout(timeout_seconds);
    KVMOVE_CHECK(layer >= 0 && layer < num_layers_, Config,
                 "layer " << layer << " is out of range: layers are in [0, " << num_layers_ << ")");
    std::unique_lock<std::mutex> lock(mu_);
    KVMOVE_CHECK(started_ || state_ != StreamState::Open, Config,
                 "request '" << request_id_ << "': call start_load() before waiting");
    bool ready = cv_.wait_for(lock, seconds(timeout_seconds),
                              [&] { return ready_[layer] || state_ != StreamState::Open; });
    raise_if_ended();
    KVMOVE_CHECK(ready, Timeout,
                 "layer " << layer << " of request '" << request_id_ << "' from '" << peer_
                          << "' not in after " << timeout_seconds << " s (" << num_ready_ << " of "
                          << num_layers_ << " layers are)");
}

std::string LoadStream::wait_all(double timeout_seconds) const {
    check_timeout(timeout_seconds);
    std::unique_lock<std::mutex> lock(mu_);
    KVMOVE_CHECK(started_ || state_ != StreamState::Open, Config,
                 "request '" << request_id_ << "': call start_load() before waiting");
    bool ended = cv_.wait_for(lock, seconds(timeout_seconds),
                              [this] { return state_ != StreamState::Open; });
    raise_if_ended();
    KVMOVE_CHECK(ended, Timeout,
                 "request '" << request_id_ << "' from '" << peer_ << "' not complete after "
                             << timeout_seconds << " s (" << num_ready_ << " of " << num_layers_
                             << " layers in" << (final_ ? ", final received" : "") << ")");
    return payload_;
}

std::vector<bool> LoadStream::layers_ready() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ready_;
}

std::string LoadStream::payload() const {
    std::lock_guard<std::mutex> lock(mu_);
    return payload_;
}

}  // namespace kvmove
