#include "transport/peer_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kvmove {

namespace {

std::string same_host_difference(const HostIdentity& here, const HostIdentity& there) {
    if (there.netns_ino != here.netns_ino || here.netns_ino == 0) {
        const std::string pid_space = same_pid_space_difference(here, there);
        return pid_space.empty() ? "another network namespace" : pid_space;
    }
    return same_pid_space_difference(here, there);
}

// The peer's memfd of `segment`, opened read/write, or -1 with `why` set.
int open_memfd(uint32_t pid, const RemoteSegment& segment, std::string& why) {
    const std::string path =
        "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(segment.memfd);
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        why = "cannot open " + path + ": " + std::strerror(errno);
        return -1;
    }
    struct stat st {};
    const int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_dev) != segment.memfd_dev ||
        static_cast<uint64_t>(st.st_ino) != segment.memfd_ino) {
        why = path + " is not the file the metadata names (a reused pid or fd)";
    } else if (static_cast<uint64_t>(st.st_size) < segment.nbytes) {
        why = path + " holds " + std::to_string(st.st_size) + " bytes, the segment " +
              std::to_string(segment.nbytes);
    } else if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        why = path + " is not sealed against shrinking (a copy could fault past its end)";
    } else {
        return fd;
    }
    close(fd);
    return -1;
}

}  // namespace

std::shared_ptr<PeerMapping> PeerMapping::open(const AgentMetadata& peer, std::string& why) {
    static const HostIdentity here = this_host();
    why = same_host_difference(here, peer.host);
    if (!why.empty()) {
        return nullptr;
    }
    std::shared_ptr<PeerMapping> mapping(new PeerMapping());
    // Before the memfd is checked: if /proc/<pid>/fd then holds the announced file, the pidfd
    // is of the process that holds it, not of a later one that reused the pid.
    std::string no_watch;
    mapping->owner_ = PidfdWatch::open(peer.host, no_watch);
    for (const RemoteSegment& segment : peer.segments) {
        if (segment.memfd < 0) {
            why = "it offers no mapping of its memory";
            return nullptr;
        }
        const int fd = open_memfd(peer.host.pid, segment, why);
        if (fd < 0) {
            return nullptr;  // what was mapped so far is unmapped with `mapping`
        }
        // MAP_POPULATE: the page tables are filled now, not by faults in the first transfer.
        void* p =
            mmap(nullptr, segment.nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        const int error = errno;
        close(fd);  // the mapping keeps the file
        if (p == MAP_FAILED) {
            why = std::string("cannot map its memfd: ") + std::strerror(error);
            return nullptr;
        }
        mapping->views_.push_back({static_cast<char*>(p), segment.addr, segment.nbytes});
    }
    return mapping;
}

PeerMapping::~PeerMapping() {
    for (const View& v : views_) {
        munmap(v.base, v.nbytes);
    }
}

bool PeerMapping::owner_alive() const {
    return owner_ == nullptr || !owner_->exited();
}

}  // namespace kvmove
