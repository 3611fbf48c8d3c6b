// The Agent's private parts: a peer, and a transfer between posting and completion.
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "transport/agent.h"

namespace kvmove {

constexpr unsigned kNotifyAmId = 0x4B56;  // "KV": notifications of plain transfers
constexpr unsigned kStreamAmId = 0x4B57;  // layer stream messages (stream/stream_message.h)

inline std::string status_text(ucs_status_t status) {
    return ucs_status_string(status);
}

struct Agent::Peer {
    Peer(Agent* a, AgentMetadata m) : agent(a), meta(std::move(m)), geometry(meta.geometry()) {}

    Agent* agent;
    AgentMetadata meta;
    KVGeometry geometry;  // of the peer's cache, in its address space
    std::string failure;  // why the peer is dead; empty while alive
    // Its notifying transfers in posting order: a notification leaves only after those
    // before it (a flush may complete at once while an earlier one is still pending).
    std::deque<InFlight*> notify_order;
    // Its memory mapped here (same host): transfers are memcpys; null: UCX carries them. Each
    // copy job holds it too, so a dropped peer is unmapped once its last copy stopped.
    std::shared_ptr<PeerMapping> mapping;
    // Declared last so they are destroyed first: the keys before their endpoint.
    std::unique_ptr<Endpoint> endpoint;
    std::vector<RkeyPtr> rkeys;  // one per segment of meta
};

// A transfer between posting and completion; UCX callbacks get a pointer to it, so it lives
// until UCX is done with it (finish(), or the worker's destruction), even if its peer goes
// first: then peer is null.
struct Agent::InFlight {
    InFlight(Agent* a, std::shared_ptr<Transfer> t, Peer* p, std::optional<std::string> n)
        : agent(a), transfer(std::move(t)), peer(p), notify(std::move(n)) {}

    Agent* agent;
    std::shared_ptr<Transfer> transfer;
    Peer* peer;
    std::optional<std::string> notify;  // sent once the flush completes
    bool flushed = false;               // its flush completed (notify_order may hold it)
    ucs_status_t flush_status = UCS_OK;
    unsigned am_id = kNotifyAmId;
    PortDone on_done;                       // a stream's transfer: told how it ended
    std::unique_ptr<uint8_t> corrupt_byte;  // fault injection: the flipped byte being put
    std::shared_ptr<CopyJob> copy;          // the mapped path's copies; null over UCX
    uint8_t* corrupt_at = nullptr;          // mapped path: where corrupt_byte lands, in copy's map
};

}  // namespace kvmove
