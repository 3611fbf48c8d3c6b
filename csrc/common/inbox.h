// Inbox<T>: what peers sent and the user has not taken yet (an agent's notifications, its
// offers): oldest first, at most a bound per peer, with a wait that has a deadline.
//
// A peer can send faster than its messages are taken: at most `per_peer` of one peer wait,
// more are refused (put() returns false; the caller counts them), so a peer cannot fill this
// process's memory. T has a `peer` (std::string) member: who sent it, as the agent attributed
// it (by endpoint, never by a name in the message).
//
// Thread-safe on its own mutex, which callers take after their own locks and never before.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace kvmove {

template <typename T>
class Inbox {
public:
    explicit Inbox(size_t per_peer) : per_peer_(per_peer) {}

    // False (nothing kept) when the sender has per_peer waiting already, or once closed.
    bool put(T item) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            size_t& waiting = waiting_[item.peer];
            if (closed_ || waiting >= per_peer_) {
                return false;
            }
            ++waiting;
            queue_.push_back(std::move(item));
        }
        cv_.notify_all();
        return true;
    }

    // Everything waiting, oldest first.
    std::vector<T> take_all() {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<T> out(std::make_move_iterator(queue_.begin()),
                           std::make_move_iterator(queue_.end()));
        queue_.clear();
        waiting_.clear();
        return out;
    }

    // The oldest, if any: it does not wait.
    std::optional<T> try_take() {
        std::lock_guard<std::mutex> lock(mu_);
        return pop_locked();
    }

    // The oldest, waiting up to timeout_seconds; nullopt at the deadline or once closed.
    std::optional<T> take(double timeout_seconds) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
                     [this] { return !queue_.empty() || closed_; });
        return pop_locked();
    }

    // The peer is gone: what it sent is moot.
    void forget(const std::string& peer) {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                    [&](const T& item) { return item.peer == peer; }),
                     queue_.end());
        waiting_.erase(peer);
    }

    // Wakes every waiter; nothing more is kept.
    void close() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            closed_ = true;
        }
        cv_.notify_all();
    }

    bool closed() const {
        std::lock_guard<std::mutex> lock(mu_);
        return closed_;
    }

private:
    std::optional<T> pop_locked() {
        if (queue_.empty()) {
            return std::nullopt;
        }
        T out = std::move(queue_.front());
        queue_.pop_front();
        if (--waiting_[out.peer] == 0) {
            waiting_.erase(out.peer);
        }
        return out;
    }

    const size_t per_peer_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<T> queue_;
    std::map<std::string, size_t> waiting_;
    bool closed_ = false;
};

}  // namespace kvmove
