// Offers: the receiver's half of a hand-off (stream_message.h), "lease <epoch> of mine is
// yours: request_id's KV goes into these blocks". The stream protocol checks an offer (its
// sender is the peer whose endpoint it came by, the epoch is of that peer's run, the ids hash
// matches) and keeps it in an OfferBox until the user takes it (Agent::offers,
// Agent::wait_offer) and streams into it or declines it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/inbox.h"
#include "common/kv_geometry.h"

namespace kvmove {

constexpr size_t kMaxQueuedOffers = 1024;  // of one peer, not yet taken

struct Offer {
    std::string peer;  // the receiver that leased the blocks (the offer's sender)
    std::string request_id;
    uint64_t epoch = 0;              // the lease; 0 with no blocks
    std::vector<BlockId> block_ids;  // the leased blocks; none: "I need none of it"
};

using OfferBox = Inbox<Offer>;

}  // namespace kvmove
