// Who progresses the Agent's UCX worker. A thread waiting for a result (wait_notification,
// Transfer::wait) progresses it itself while the progress thread steps aside; at any other
// time the progress thread does. Whoever drives also checks the peers' liveness and the
// streams' deadlines and sends the deferred work; with nothing done, it yields while a
// transfer is pending, a waiter polls (yielding) for kPollSeconds more, and otherwise it
// sleeps on the worker's event fd.
//
// Why (docs/transfer.md, "A one-block write over tcp"): a waiter used to poll for 200 us
// beside a progress thread that yielded through 2,000 idle rounds before it slept (between
// pings it never slept), and the waiter seldom got the worker's lock; on a loaded 2-core host
// the bytes on the socket waited for a core, and a one-block write + notification over tcp
// took 170-420 us one way. Now one thread per agent drives at a time, and a notification
// reaches the thread that wants it without a hand-off through a condition variable.
#include <poll.h>

#include <algorithm>
#include <thread>

#include "transport/agent.h"
#include "transport/agent_internal.h"

namespace kvmove {

namespace {

// Idle progress calls before the progress thread sleeps, while a transfer of this agent is
// pending (its completion, an acknowledgement, is a socket round trip away); with none
// pending it sleeps after one idle call: the worker's event fd wakes it when a peer sends.
constexpr int kIdleSpins = 2000;
// How long a waiter polls (yielding its core between rounds) after the last progress before
// it sleeps: a reply that comes that soon needs no wake-up, which on a quiet machine halves a
// same-host round trip (docs/transfer.md, "Error mode"). Yielding keeps it from starving a
// thread that shares its core, such as the peer's on a loaded 2-core host.
constexpr double kPollSeconds = 200e-6;
constexpr int kSleepMs = 100;          // longest sleep; stop_ is checked at least this often
constexpr double kTickSeconds = 1e-3;  // how often the streams' deadlines are checked
// How often the progress thread asks the paths whether their peers live (a mapped peer's
// pidfd: one poll() each; a transfer checks them too, before it posts).
constexpr double kCheckPeersSeconds = 10e-3;

}  // namespace

void Agent::progress_loop() {
    int idle = 0;
    double last_progress = 0;
    while (!stop_) {
        // Other threads that want the worker go first: std::mutex is not fair, and this
        // loop would otherwise take it back before a woken waiter runs, for as long as it
        // spins (measured: 16 MB layer puts landing 40 ms late instead of 2 ms).
        while (lock_waiters_.load(std::memory_order_relaxed) > 0) {
            std::this_thread::yield();
        }
        step_aside();
        drive_round(idle, kSleepMs * 1e-3, 0, last_progress);
    }
}

// One round of whoever drives the worker: progress it; with nothing done, yield while a
// transfer is pending (what completes it is a socket round trip away) or for poll_seconds
// after last_progress, else sleep on the worker's event fd (at most max_seconds).
void Agent::drive_round(int& idle, double max_seconds, double poll_seconds, double& last_progress) {
    bool pending = false;
    if (progress_once(pending)) {
        idle = 0;
        last_progress = steady_seconds();
        return;
    }
    if ((pending && ++idle < kIdleSpins) || steady_seconds() - last_progress < poll_seconds) {
        std::this_thread::yield();
        return;
    }
    idle = 0;
    sleep_until_work(max_seconds);
}

std::shared_ptr<Agent::Driving> Agent::make_driving() {
    return std::make_shared<Driving>(this);
}

// While user threads drive the worker, waits until the last one leaves (or close()).
void Agent::step_aside() {
    std::unique_lock<std::mutex> lock(aside_mu_);
    aside_cv_.wait(lock, [this] { return waiters_driving_ == 0 || stop_; });
}

// Progresses the worker from this thread until done() (true), the timeout or close()
// (false). done() runs without the worker lock.
bool Agent::progress_until(const std::function<bool()>& done, double timeout_seconds) {
    {
        std::lock_guard<std::mutex> aside(aside_mu_);
        ++waiters_driving_;
    }
    double last_progress = steady_seconds();
    const double until = last_progress + timeout_seconds;
    bool finished = false;
    int idle = 0;
    for (;;) {
        if ((finished = done()) || closed_) {
            break;
        }
        const double left = until - steady_seconds();
        if (left <= 0) {
            break;
        }
        drive_round(idle, std::min(left, kSleepMs * 1e-3), kPollSeconds, last_progress);
    }
    {
        std::lock_guard<std::mutex> aside(aside_mu_);
        --waiters_driving_;
    }
    aside_cv_.notify_all();  // the progress thread takes over
    return finished;
}

// One round: the worker, the peers' liveness, the streams' deadlines, the deferred work.
// Returns whether the worker did anything; pending: whether a transfer is still under way.
bool Agent::progress_once(bool& pending) {
    std::lock_guard<std::mutex> lock(worker_mu_);
    if (stop_) {  // close() tears the worker down holding the lock
        return false;
    }
    const unsigned progressed = ucp_worker_progress(worker_.get());
    const double now = steady_seconds();
    if (now - last_check_ >= kCheckPeersSeconds) {
        check_peers();
        last_check_ = now;
    }
    if (now - last_tick_ >= kTickSeconds) {
        streams_.tick(now);
        last_tick_ = now;
    }
    drain_deferred();
    pending = !in_flight_.empty() || !polling_.empty();
    return progressed > 0;
}

// After a post: wakes the progress thread if a path has work that only its poll() completes
// (copies, held messages), so that it sleeps no longer than their deadline. UCX's own work
// needs no wake-up: its completions come through the event fd the thread sleeps on, and a
// wake-up costs the posting thread a syscall and the sleeper a trip through the scheduler
// (over tcp, one of the extra wake-ups per transfer in docs/transfer.md's timeline).
void Agent::wake_for_paths() {
    if (!polling_.empty()) {
        ucp_worker_signal(worker_.get());
    }
}

// Sleeps until there is work, the next deadline (of the streams or the paths), or
// max_seconds.
void Agent::sleep_until_work(double max_seconds) {
    ucs_status_t armed = UCS_OK;
    double until_deadline = 0;
    {
        std::lock_guard<std::mutex> lock(worker_mu_);
        if (stop_) {
            return;
        }
        armed = ucp_worker_arm(worker_.get());
        double next = streams_.next_deadline();
        for (const std::shared_ptr<Path>& path : polling_) {
            next = std::min(next, path->next_deadline());
        }
        until_deadline = next - steady_seconds();
    }
    if (armed == UCS_OK) {
        const double ms = std::clamp(until_deadline * 1e3 + 1, 0.0, max_seconds * 1e3);
        pollfd fd{event_fd_, POLLIN, 0};
        poll(&fd, 1, static_cast<int>(ms));
    }
}

}  // namespace kvmove
