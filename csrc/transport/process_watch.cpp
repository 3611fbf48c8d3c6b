#include "transport/process_watch.h"

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace kvmove {

namespace {

uint64_t inode_of(const char* path) {
    struct stat st {};
    return stat(path, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

std::string boot_id() {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string id;
    std::getline(in, id);
    return id.size() <= kMaxBootIdBytes && first_unprintable(id) == std::string::npos ? id : "";
}

}  // namespace

HostIdentity this_host() {
    HostIdentity host;
    host.boot_id = boot_id();
    host.netns_ino = inode_of("/proc/self/ns/net");
    host.pidns_ino = inode_of("/proc/self/ns/pid");
    host.pid = static_cast<uint32_t>(getpid());
    return host;
}

std::string same_pid_space_difference(const HostIdentity& here, const HostIdentity& there) {
    if (here.boot_id.empty() || there.boot_id != here.boot_id) {
        return "another host (boot_id '" + there.boot_id + "', ours '" + here.boot_id + "')";
    }
    if (there.pidns_ino != here.pidns_ino || here.pidns_ino == 0) {
        return "another pid namespace (its pid means nothing here)";
    }
    return "";
}

std::shared_ptr<PidfdWatch> PidfdWatch::open(const HostIdentity& peer, std::string& why) {
    static const HostIdentity here = this_host();
    why = same_pid_space_difference(here, peer);
    if (!why.empty()) {
        return nullptr;
    }
#ifdef SYS_pidfd_open
    const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, peer.pid, 0));
    if (pidfd >= 0) {
        return std::shared_ptr<PidfdWatch>(new PidfdWatch(pidfd, peer.pid));
    }
    why = "pidfd_open(" + std::to_string(peer.pid) + "): " + std::strerror(errno);
#else
    why = "pidfds are not available";
#endif
    return nullptr;
}

PidfdWatch::~PidfdWatch() {
    close(pidfd_);
}

bool PidfdWatch::exited() const {
    pollfd fd{pidfd_, POLLIN, 0};
    return poll(&fd, 1, 0) > 0;  // readable: the process exited
}

}  // namespace kvmove
