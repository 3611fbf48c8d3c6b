// The Agent's progress thread: it progresses the UCX worker, checks the peers' liveness and
// the streams' deadlines, sends the deferred work, and sleeps on the worker's event fd when
// there is nothing to do.
#include <poll.h>

#include <algorithm>
#include <thread>

#include "transport/agent.h"
#include "transport/agent_internal.h"

namespace kvmove {

namespace {

constexpr int kIdleSpins = 2000;       // progress calls with nothing done before sleeping
constexpr int kSleepMs = 100;          // longest sleep; stop_ is checked at least this often
constexpr double kTickSeconds = 1e-3;  // how often the streams' deadlines are checked
// How often the progress thread asks the paths whether their peers live (a mapped peer's
// pidfd: one poll() each; a transfer checks them too, before it posts).
constexpr double kCheckPeersSeconds = 10e-3;

}  // namespace

void Agent::progress_loop() {
    double last_tick = 0;
    double last_check = 0;
    int idle = 0;
    while (!stop_) {
        // Other threads that want the worker go first: std::mutex is not fair, and this
        // loop would otherwise take it back before a woken waiter runs, for as long as it
        // spins (measured: 16 MB layer puts landing 40 ms late instead of 2 ms).
        while (lock_waiters_.load(std::memory_order_relaxed) > 0) {
            std::this_thread::yield();
        }
        idle = progress_once(last_tick, last_check) ? 0 : idle + 1;
        if (idle < kIdleSpins) {
            std::this_thread::yield();
            continue;
        }
        idle = 0;
        sleep_until_work();
    }
}

// One round: the worker, the peers' liveness, the streams' deadlines, the deferred work.
// Returns whether the worker did anything.
bool Agent::progress_once(double& last_tick, double& last_check) {
    std::lock_guard<std::mutex> lock(worker_mu_);
    const unsigned progressed = ucp_worker_progress(worker_.get());
    const double now = steady_seconds();
    if (now - last_check >= kCheckPeersSeconds) {
        check_peers();
        last_check = now;
    }
    if (now - last_tick >= kTickSeconds) {
        streams_.tick(now);
        last_tick = now;
    }
    drain_deferred();
    return progressed > 0;
}

// Sleeps until there is work, the next deadline (of the streams or the paths), or kSleepMs
// (to see stop_).
void Agent::sleep_until_work() {
    ucs_status_t armed = UCS_OK;
    double until_deadline = 0;
    {
        std::lock_guard<std::mutex> lock(worker_mu_);
        armed = ucp_worker_arm(worker_.get());
        double next = streams_.next_deadline();
        for (const std::shared_ptr<Path>& path : polling_) {
            next = std::min(next, path->next_deadline());
        }
        until_deadline = next - steady_seconds();
    }
    if (armed == UCS_OK) {
        const double ms = std::clamp(until_deadline * 1e3 + 1, 0.0, double(kSleepMs));
        pollfd fd{event_fd_, POLLIN, 0};
        poll(&fd, 1, static_cast<int>(ms));
    }
}

}  // namespace kvmove
