// PeerRuns: the runs of each peer name an agent has added, to tell a peer's new run from a
// replay of an old one by identity, never by a clock.
//
// A run is an incarnation (transport/metadata.h: a random nonzero number an agent picks at
// each start). Per name, the run added last is current; those it replaced are retired, and
// metadata of a retired run is a replay (a stale copy of an old run's) that the agent refuses.
// Any other incarnation is a new run. Removing a peer retires nothing: its current run may
// rejoin, and it is retired once another run of the name is added.
//
// We ordered runs by their wall-clock start (started_ns) before, and refused the "older" one:
// a new run on a host whose clock was behind the old run's (or stepped back) was refused
// (issue 27). An incarnation cannot go backwards; it can only be a run seen or one not seen.
//
// Bounds: per name, the last kMaxRetiredRuns retired runs (an older one is forgotten, and
// would be taken for a new run); names: those of the agent's peers, plus at most
// kMaxFormerNames others (names no longer peers), the least recently added forgotten first.
// So a flood of names or restarts, which needs the deployment key anyway, holds at most
// (max_peers + kMaxFormerNames) names of 255 bytes with 64 runs each: under 1 KiB a name.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>

namespace kvmove {

class PeerRuns {
public:
    static constexpr size_t kMaxRetiredRuns = 64;
    static constexpr size_t kMaxFormerNames = 1024;

    // Whether `incarnation` is a run of `name` that another replaced.
    bool retired(const std::string& name, uint32_t incarnation) const;
    // The run of `name` added last (0: none known).
    uint32_t current(const std::string& name) const;
    // Records `incarnation` as the current run of `name`, retiring the one it replaces; then
    // forgets the least recently added names for which is_peer is false, beyond
    // kMaxFormerNames of them.
    void added(const std::string& name, uint32_t incarnation,
               const std::function<bool(const std::string&)>& is_peer);

private:
    struct Runs {
        uint32_t current = 0;
        std::deque<uint32_t> retired;  // oldest first
        uint64_t added_seq = 0;        // when it was last added (adds_ then), for eviction
    };

    void forget_former_names(const std::function<bool(const std::string&)>& is_peer);

    std::map<std::string, Runs> runs_;
    uint64_t adds_ = 0;
};

}  // namespace kvmove
