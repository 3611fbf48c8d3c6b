#include "transport/peer_runs.h"

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kvmove {

bool PeerRuns::retired(const std::string& name, uint32_t incarnation) const {
    auto it = runs_.find(name);
    if (it == runs_.end()) {
        return false;
    }
    const std::deque<uint32_t>& retired = it->second.retired;
    return std::find(retired.begin(), retired.end(), incarnation) != retired.end();
}

uint32_t PeerRuns::current(const std::string& name) const {
    auto it = runs_.find(name);
    return it == runs_.end() ? 0 : it->second.current;
}

void PeerRuns::added(const std::string& name, uint32_t incarnation,
                     const std::function<bool(const std::string&)>& is_peer) {
    Runs& runs = runs_[name];
    runs.added_seq = ++adds_;
    if (runs.current == incarnation) {
        return;
    }
    if (runs.current != 0) {
        runs.retired.push_back(runs.current);
        if (runs.retired.size() > kMaxRetiredRuns) {
            runs.retired.pop_front();
        }
    }
    runs.current = incarnation;
    forget_former_names(is_peer);
}

// A scan per add once the names exceed the bound: adding a peer creates a UCX endpoint, which
// costs far more than walking a few thousand names.
void PeerRuns::forget_former_names(const std::function<bool(const std::string&)>& is_peer) {
    if (runs_.size() <= kMaxFormerNames) {
        return;
    }
    std::vector<std::map<std::string, Runs>::iterator> former;
    for (auto it = runs_.begin(); it != runs_.end(); ++it) {
        if (!is_peer(it->first)) {
            former.push_back(it);
        }
    }
    if (former.size() <= kMaxFormerNames) {
        return;
    }
    auto excess = former.begin() + static_cast<std::ptrdiff_t>(former.size() - kMaxFormerNames);
    std::nth_element(former.begin(), excess, former.end(),
                     [](auto a, auto b) { return a->second.added_seq < b->second.added_seq; });
    for (auto it = former.begin(); it != excess; ++it) {
        runs_.erase(*it);
    }
}

}  // namespace kvmove
