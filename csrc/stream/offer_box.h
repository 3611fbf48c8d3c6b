// OfferBox: the offers a sender received and its user has not taken yet.
//
// An offer is the receiver's half of a hand-off (stream_message.h): "lease <epoch> of mine is
// yours: request_id's KV goes into these blocks". The stream protocol checks it (its sender is
// the peer whose endpoint it came by, the epoch is of that peer's run, the ids hash matches)
// and puts it here; the user takes it (Agent::offers, Agent::wait_offer) and streams into it
// or declines it. A peer can send offers faster than they are taken: at most
// kMaxQueuedOffers of one peer wait here, more are dropped (and counted by the protocol), so
// a peer cannot fill this process's memory.
//
// Thread-safe on its own mutex, which is taken after the port's lock and never before it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/kv_geometry.h"

namespace kvmove {

constexpr size_t kMaxQueuedOffers = 1024;  // of one peer, not yet taken

struct Offer {
    std::string peer;  // the receiver that leased the blocks (the offer's sender)
    std::string request_id;
    uint64_t epoch = 0;              // the lease; 0 with no blocks
    std::vector<BlockId> block_ids;  // the leased blocks; none: "I need none of it"
};

class OfferBox {
public:
    // False (the offer dropped) when `offer.peer` has kMaxQueuedOffers waiting already.
    bool put(Offer offer);
    // Every offer waiting, oldest first.
    std::vector<Offer> take_all();
    // The oldest offer, waiting up to timeout_seconds; nullopt at the deadline or once closed.
    std::optional<Offer> take(double timeout_seconds);
    // The peer's connection is gone: its offers are moot (its leases ended with it).
    void forget(const std::string& peer);
    void close();  // wakes every waiter; nothing more is put

private:
    Offer pop_locked();  // mu_ held, queue_ not empty

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Offer> queue_;
    std::map<std::string, size_t> per_peer_;
    bool closed_ = false;
};

}  // namespace kvmove
