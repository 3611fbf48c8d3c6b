// The Agent's private parts: a peer, and a transfer between posting and completion.
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>

#include "transport/agent.h"
#include "transport/process_watch.h"

namespace kvmove {

constexpr unsigned kNotifyAmId = 0x4B56;  // "KV": notifications of plain transfers
constexpr unsigned kStreamAmId = 0x4B57;  // layer stream messages (stream/stream_message.h)

struct Agent::Peer {
    Peer(Agent* a, AgentMetadata m) : agent(a), meta(std::move(m)), geometry(meta.geometry()) {}

    Agent* agent;
    AgentMetadata meta;
    KVGeometry geometry;  // of the peer's cache, in its address space
    std::string failure;  // why the peer is dead; empty while alive
    // Its notifying transfers in posting order: a notification leaves only after those
    // before it (a batch may land at once while an earlier one is still pending).
    std::deque<InFlight*> notify_order;
    // How its bytes and messages move (transport/path.h). Shared: a path with copies or held
    // messages outlives the peer in Agent::polling_ until they are done.
    std::shared_ptr<Path> path;
    // Its process, where this host can watch it (null: elsewhere): a cut-off peer that may
    // still reach our memory is harmless only once it exited (stream/stream_protocol.h).
    std::shared_ptr<const ProcessWatch> process;
};

// The agent as its transfers' Driver (transport/driver.h): the thread that waits for a
// transfer progresses the worker (Agent::progress_until) until the agent closes.
struct Agent::Driving : Driver {
    explicit Driving(Agent* a) : agent(a) {}
    void progress_until(const std::function<bool()>& done, double timeout_seconds) override {
        std::shared_lock<std::shared_mutex> lock(mu);
        if (agent != nullptr) {
            agent->progress_until(done, timeout_seconds);
        }
    }
    // From close(): waits for the waiters driving now (they see the agent closed and leave).
    void detach() {
        std::unique_lock<std::shared_mutex> lock(mu);
        agent = nullptr;
    }

    std::shared_mutex mu;
    Agent* agent;
};

// A transfer between posting and completion; its path's callbacks point to it, so it lives
// until finish() (or the agent's close), even if its peer goes first: then peer is null.
struct Agent::InFlight {
    InFlight(Agent* a, std::shared_ptr<Transfer> t, Peer* p, std::optional<std::string> n,
             unsigned id = kNotifyAmId, PortDone d = nullptr)
        : agent(a),
          transfer(std::move(t)),
          peer(p),
          notify(std::move(n)),
          am_id(id),
          on_done(std::move(d)) {}

    Agent* agent;
    std::shared_ptr<Transfer> transfer;
    Peer* peer;
    std::optional<std::string> notify;         // sent once its batch landed...
    std::function<std::string()> make_notify;  // ...or, when set, what this makes then
    unsigned am_id;                            // of the notification: plain, or a stream message
    PortDone on_done;                          // a stream's transfer: told how it ended
    bool landed = false;                       // its batch landed (notify_order may hold it)
    PortOutcome outcome;                       // how the batch ended
};

}  // namespace kvmove
