// Completion<State, kOpen>: what a transfer and a layer stream share: a state that starts at
// kOpen and ends once (the first end wins, later ones are ignored), the error it ended with,
// and the condition its waiters block on. Each subclass adds its own waits and data (a
// transfer's stats, a stream's layer times) behind the same mutex.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <utility>

#include "common/errors.h"

namespace kvmove {

template <typename State, State kOpen>
class Completion {
public:
    virtual ~Completion() = default;

    State state() const {
        std::lock_guard<std::mutex> lock(mu_);
        return state_;
    }
    // Empty unless it ended with an error.
    std::string error() const {
        std::lock_guard<std::mutex> lock(mu_);
        return error_;
    }
    // Ends it and wakes the waiters; false (nothing changed) when it had ended already.
    bool complete(State state, ErrorKind kind = ErrorKind::Transfer, std::string error = "") {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!set_state_locked(state, kind, std::move(error))) {
                return false;
            }
        }
        cv_.notify_all();
        return true;
    }

protected:
    // mu_ held; the caller notifies cv_ once it released mu_.
    bool set_state_locked(State state, ErrorKind kind, std::string error) {
        if (state_ != kOpen) {
            return false;
        }
        state_ = state;
        error_kind_ = kind;
        error_ = std::move(error);
        on_end_locked();
        return true;
    }
    // mu_ held, right after the state ended (a transfer stamps its completion time).
    virtual void on_end_locked() {}

    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    State state_ = kOpen;
    ErrorKind error_kind_ = ErrorKind::Transfer;
    std::string error_;
};

}  // namespace kvmove
