// PidfdWatch: whether a peer's process on this host has exited (stream/stream_port.h's
// ProcessWatch), from a pidfd.
//
// A peer that can reach this agent's memory without the agent's say (a mapped peer writes
// with memcpy; UCX shared memory and cma likewise) can still write after the agent cut it off,
// for as long as its process lives: only its exit ends that for certain. The stream protocol
// keeps the blocks of such a peer's cancelled leases quarantined until then
// (stream/stream_protocol.h).
//
// The pidfd is opened when the peer is added. A pid in the peer's metadata that was already
// reused by then names another process, which only makes a quarantine last longer, never end
// early.
#pragma once

#include <memory>
#include <string>

#include "stream/stream_port.h"
#include "transport/metadata.h"

namespace kvmove {

class PidfdWatch final : public ProcessWatch {
public:
    // A watch on the process `peer` describes, or null with `why` set: it runs on another host
    // or in another pid namespace (its pid means nothing here), or pidfds are not available.
    static std::shared_ptr<PidfdWatch> open(const HostIdentity& peer, std::string& why);
    ~PidfdWatch() override;
    PidfdWatch(const PidfdWatch&) = delete;
    PidfdWatch& operator=(const PidfdWatch&) = delete;

    // True once the process exited (the pidfd is readable).
    bool exited() const override;
    uint32_t pid() const { return pid_; }

private:
    PidfdWatch(int pidfd, uint32_t pid) : pidfd_(pidfd), pid_(pid) {}

    int pidfd_;
    uint32_t pid_;
};

// This process: boot_id, its network and pid namespaces, its pid.
HostIdentity this_host();

// Why `there` is not a process of this host's kernel and pid namespace ("" when it is).
std::string same_pid_space_difference(const HostIdentity& here, const HostIdentity& there);

}  // namespace kvmove
