#include "stream/offer_box.h"

#include <algorithm>
#include <chrono>

namespace kvmove {

bool OfferBox::put(Offer offer) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        size_t& waiting = per_peer_[offer.peer];
        if (closed_ || waiting >= kMaxQueuedOffers) {
            return false;
        }
        ++waiting;
        queue_.push_back(std::move(offer));
    }
    cv_.notify_all();
    return true;
}

Offer OfferBox::pop_locked() {
    Offer out = std::move(queue_.front());
    queue_.pop_front();
    if (--per_peer_[out.peer] == 0) {
        per_peer_.erase(out.peer);
    }
    return out;
}

std::vector<Offer> OfferBox::take_all() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Offer> out(std::make_move_iterator(queue_.begin()),
                           std::make_move_iterator(queue_.end()));
    queue_.clear();
    per_peer_.clear();
    return out;
}

std::optional<Offer> OfferBox::take(double timeout_seconds) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
                 [this] { return !queue_.empty() || closed_; });
    if (queue_.empty()) {
        return std::nullopt;
    }
    return pop_locked();
}

void OfferBox::forget(const std::string& peer) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                [&](const Offer& o) { return o.peer == peer; }),
                 queue_.end());
    per_peer_.erase(peer);
}

void OfferBox::close() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
        queue_.clear();
        per_peer_.clear();
    }
    cv_.notify_all();
}

}  // namespace kvmove
