// PeerMapping: a same-host peer's KV memory, mapped into this process.
//
// An agent's own cache lives in a memfd (memory/region.h), and its metadata says where: the
// host (transport/metadata.h HostIdentity), its pid, and per segment the fd number and the
// file's (st_dev, st_ino). A peer on the same host (same boot, network and pid namespace)
// opens /proc/<pid>/fd/<fd>, which the kernel allows a process of the same user (a
// PTRACE_MODE_READ check: Yama's ptrace_scope restricts only attaching, so it does not stand
// in the way), checks that it is that very file, and maps it shared. A transfer to the peer is
// then a memcpy between the two caches: no kernel copy, no socket, no CPU on the other side.
//
// We open /proc/<pid>/fd rather than pass the fd over a Unix socket (SCM_RIGHTS) because the
// metadata already goes both ways and needs no second channel; and rather than pidfd_getfd,
// which demands ptrace-attach rights (Yama refuses it by default). A named /dev/shm object
// would outlive a SIGKILLed owner; a memfd dies with its last fd and mapping.
//
// The mapping stays valid as long as we hold it, even when the peer dies (the file is ours
// too then), so a copy in flight into a dead peer is harmless; its pages go when the last
// holder (this object, shared by the copies in flight) unmaps them. The file is sealed against
// shrinking, so no peer can make a copy fault past its end.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/metadata.h"
#include "transport/process_watch.h"

namespace kvmove {

class PeerMapping {
public:
    // Every segment of the peer mapped here, or null with `why` set: the peer runs elsewhere,
    // offers no mapping, or the kernel refused (then UCX carries the transfers).
    static std::shared_ptr<PeerMapping> open(const AgentMetadata& peer, std::string& why);
    ~PeerMapping();
    PeerMapping(const PeerMapping&) = delete;
    PeerMapping& operator=(const PeerMapping&) = delete;

    // False once the peer's process exited (a pidfd says so at once, where UCX's keepalive
    // over shared memory takes its interval); true where pidfds are not available.
    bool owner_alive() const;

    // Where the peer's address `addr` (in its segment `segment`) is mapped here. The caller
    // keeps within the segment (the metadata decoder checked every plane lies in one).
    char* at(uint32_t segment, uint64_t addr) const {
        const View& v = views_[segment];
        return v.base + (addr - v.addr);
    }

private:
    struct View {
        char* base;       // our mapping
        uint64_t addr;    // the segment's address in the peer
        uint64_t nbytes;  // mapped bytes
    };
    PeerMapping() = default;

    std::vector<View> views_;
    std::shared_ptr<PidfdWatch> owner_;  // opened before its memfd was checked; null: none
};

}  // namespace kvmove
