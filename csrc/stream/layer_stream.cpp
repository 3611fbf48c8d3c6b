#include "stream/layer_stream.h"

#include <algorithm>
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

uint64_t checksum_seed(uint64_t epoch, int64_t layer, size_t index) {
    return epoch ^ (static_cast<uint64_t>(layer) * 0x9E3779B97F4A7C15ULL) ^
           (static_cast<uint64_t>(index) * 0xC2B2AE3D27D4EB4FULL);
}

double steady_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

StreamCompletion::StreamCompletion(int64_t num_layers)
    : times_(static_cast<size_t>(num_layers), LayerTiming{kNever, kNever}) {}

std::vector<LayerTiming> StreamCompletion::layer_times() const {
    std::lock_guard<std::mutex> lock(mu_);
    return times_;
}

SaveStream::SaveStream(StreamProtocol* protocol, std::string peer, std::vector<BlockId> local_ids,
                       std::vector<BlockId> remote_ids, std::string request_id, int64_t num_layers,
                       uint64_t epoch, bool checksums)
    : StreamCompletion(num_layers),
      protocol_(protocol),
      peer_(std::move(peer)),
      local_ids_(std::move(local_ids)),
      remote_ids_(std::move(remote_ids)),
      request_id_(std::move(request_id)),
      num_layers_(num_layers),
      ids_hash_(hash_ids(remote_ids_)),
      epoch_(epoch),
      checksums_(checksums),
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
        KVMOVE_CHECK(!cancelled_, Transfer, describe() << " was cancelled by its receiver");
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
        if (phase_ == Phase::Waiting) {
            held_.push_back({layer, cuda_event});  // posted once the receiver says Go
            return;
        }
        ++in_flight_;
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
        KVMOVE_CHECK(!cancelled_, Transfer, describe() << " was cancelled by its receiver");
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
        end_ = StreamEnd::Abort;  // layers saved before it still land (after the Go)
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

bool SaveStream::answered() const {
    std::lock_guard<std::mutex> lock(mu_);
    return phase_ != Phase::Waiting;
}

std::vector<SavedLayer> SaveStream::go() {
    std::lock_guard<std::mutex> lock(mu_);
    if (phase_ != Phase::Waiting) {
        return {};
    }
    phase_ = Phase::Go;
    std::vector<SavedLayer> out;
    out.swap(held_);
    in_flight_ += static_cast<int64_t>(out.size());
    return out;
}

void SaveStream::refused(const std::string& reason) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (phase_ != Phase::Waiting) {
            return;
        }
        phase_ = Phase::Refused;
        held_.clear();
        close_sent_ = true;  // nothing was written: there is nothing to end
        set_state_locked(
            StreamState::Failed, ErrorKind::Transfer,
            "'" + peer_ + "' refused " + describe() + ": " + reason + " (nothing was written)");
    }
    cv_.notify_all();
}

bool SaveStream::cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != StreamState::Open || close_sent_ || cancelled_) {
        return false;
    }
    cancelled_ = true;
    end_ = StreamEnd::Abort;  // the Final, if finish() was called, is no longer wanted
    held_.clear();
    return close_due_locked();
}

bool SaveStream::was_cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
}

bool SaveStream::close_due_locked() {
    if (end_ == StreamEnd::None || close_sent_ || in_flight_ > 0 || !held_.empty()) {
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
        --in_flight_;
        if (ok) {
            times_[layer].landed = steady_seconds();
        } else if (!cancelled_) {
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
        KVMOVE_FAIL(Timeout, "stream of request '"
                                 << request_id_ << "' to '" << peer_ << "' still open after "
                                 << timeout_seconds << " s (" << landed << " of " << num_layers_
                                 << " layers landed"
                                 << (phase_ == Phase::Waiting ? ", no answer to its Begin" : "")
                                 << ")");
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
                       std::vector<BlockId> local_ids, int64_t num_layers, uint64_t epoch)
    : StreamCompletion(num_layers),
      protocol_(protocol),
      peer_(std::move(peer)),
      request_id_(std::move(request_id)),
      local_ids_(std::move(local_ids)),
      num_layers_(num_layers),
      ids_hash_(hash_ids(local_ids_)),
      epoch_(epoch),
      landed_(static_cast<size_t>(num_layers), 0),
      ready_(static_cast<size_t>(num_layers), 0),
      bad_(local_ids_.size(), 0) {}

void LoadStream::start_load() {
    protocol_->start_load(*this);
}

void LoadStream::cancel() {
    protocol_->cancel_load(*this);
}

void LoadStream::check_startable() const {
    std::lock_guard<std::mutex> lock(mu_);
    // A stream that already completed or aborted is fine: the waits report it.
    KVMOVE_CHECK(!started_, Config,
                 "start_load() of request '" << request_id_ << "' with '" << peer_
                                             << "' was already called");
    KVMOVE_CHECK(state_ != StreamState::Failed, Config,
                 "start_load() of request '" << request_id_ << "' with '" << peer_
                                             << "' after it failed: " << error_);
}

void LoadStream::mark_started() {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = true;
}

bool LoadStream::done_locked() const {
    return final_ && num_ready_ == num_layers_;
}

bool LoadStream::finish_if_done_locked() {
    return done_locked() && set_state_locked(StreamState::Done, ErrorKind::Transfer, "");
}

bool LoadStream::layer_landed(int64_t layer, bool verified) {
    bool ended = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ != StreamState::Open || landed_[layer]) {
            return false;
        }
        landed_[layer] = 1;
        times_[layer].landed = steady_seconds();
        if (verified) {
            ready_[layer] = 1;
            ++num_ready_;
        }
        ended = finish_if_done_locked();
    }
    cv_.notify_all();
    return ended;
}

bool LoadStream::layer_verified(int64_t layer, const std::vector<size_t>& bad) {
    bool ended = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ != StreamState::Open || ready_[layer]) {
            return false;
        }
        ready_[layer] = 1;
        ++num_ready_;
        if (bad.empty()) {
            ended = finish_if_done_locked();
        } else {
            std::ostringstream os;
            os << "request '" << request_id_ << "' from '" << peer_ << "': layer " << layer
               << " of blocks";
            for (size_t k = 0; k < bad.size() && k < 8; ++k) {
                bad_[bad[k]] = 1;
                os << " " << local_ids_[bad[k]];
            }
            for (size_t k = 8; k < bad.size(); ++k) {
                bad_[bad[k]] = 1;
            }
            os << (bad.size() > 8 ? " ..." : "") << " (" << bad.size() << " of "
               << local_ids_.size() << ") does not match the sender's checksums: this KV "
               << "must not be used";
            ended = set_state_locked(StreamState::Failed, ErrorKind::Checksum, os.str());
        }
    }
    cv_.notify_all();
    return ended;
}

bool LoadStream::final_arrived(const std::string& payload) {
    bool ended = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_ != StreamState::Open || final_) {
            return false;
        }
        final_ = true;
        payload_ = payload;
        auto missing = std::find(landed_.begin(), landed_.end(), 0);
        if (missing != landed_.end()) {
            // A sender sends its Final after every Layer message, on the same connection.
            ended = set_state_locked(StreamState::Failed, ErrorKind::Transfer,
                                     "sender '" + peer_ + "' ended request '" + request_id_ +
                                         "' before layer " +
                                         std::to_string(missing - landed_.begin()) + " landed");
        } else {
            ended = finish_if_done_locked();
        }
    }
    cv_.notify_all();
    return ended;
}

void LoadStream::set_released() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        released_ = true;
    }
    cv_.notify_all();
}

bool LoadStream::released() const {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
}

bool LoadStream::wait_released(double timeout_seconds) const {
    check_timeout(timeout_seconds);
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, seconds(timeout_seconds), [this] { return released_; });
}

std::vector<BlockId> LoadStream::bad_blocks() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<BlockId> out;
    for (size_t i = 0; i < bad_.size(); ++i) {
        if (bad_[i]) {
            out.push_back(local_ids_[i]);
        }
    }
    return out;
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
    return std::vector<bool>(ready_.begin(), ready_.end());
}

int64_t LoadStream::num_layers_landed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return std::count(landed_.begin(), landed_.end(), 1);
}

std::string LoadStream::payload() const {
    std::lock_guard<std::mutex> lock(mu_);
    return payload_;
}

}  // namespace kvmove
