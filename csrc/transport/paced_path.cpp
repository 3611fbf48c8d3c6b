#include "transport/paced_path.h"

#include <algorithm>

#include "stream/layer_stream.h"
#include "transport/ucx_path.h"

namespace kvmove {

namespace {

// Windows of one less urgent batch in flight at once while no hand-off is: four, so that the
// link stays busy across a window's flush; one while hand-offs came within kRecent, since a
// hand-off that starts waits for what is in flight.
constexpr int kWindowsInFlight = 4;
constexpr int kWindowsInFlightNearHandoffs = 1;
constexpr double kRecent = 0.1;  // seconds

}  // namespace

PacedPath::PacedPath(std::unique_ptr<Path> inner, std::shared_ptr<Pacer> pacer)
    : WrappingPath(std::move(inner)), pacer_(std::move(pacer)) {}

void PacedPath::post(PathBatch batch, PathDone done) {
    const bool handoff = batch.traffic == TrafficClass::Handoff;
    if (handoff && queue_.empty()) {  // nothing ahead of it: straight to UCX
        ++pacer_->handoffs_in_flight;
        inner_->post(std::move(batch),
                     [pacer = pacer_, done = std::move(done)](const PortOutcome& outcome) {
                         --pacer->handoffs_in_flight;
                         pacer->handoff_ended = steady_seconds();
                         done(outcome);
                     });
        return;
    }
    auto item = std::make_shared<Queued>();
    item->lease = batch.lease;
    item->handoff = handoff;
    item->done = std::move(done);
    item->waiting_since = steady_seconds();
    if (handoff) {
        item->windows.push_back(std::move(batch));
    } else {
        item->windows = cut(std::move(batch));
    }
    queue_.push_back(std::move(item));
    pump(steady_seconds());
}

std::deque<PathBatch> PacedPath::cut(PathBatch batch) {
    std::deque<PathBatch> windows;
    PathBatch window;
    uint64_t in_window = 0;
    auto start = [&] {
        windows.push_back(std::move(window));
        window = PathBatch{};
        in_window = 0;
    };
    for (const RangePair& range : batch.ranges) {
        for (uint64_t at = 0; at < range.nbytes;) {
            const uint64_t n = std::min(range.nbytes - at, kWindowBytes - in_window);
            window.ranges.push_back(
                {range.here + at, range.there + at, n, range.here_segment, range.there_segment});
            at += n;
            in_window += n;
            if (in_window == kWindowBytes) {
                start();
            }
        }
    }
    if (!window.ranges.empty() || windows.empty()) {
        start();
    }
    for (PathBatch& w : windows) {
        w.direction = batch.direction;
        w.lease = batch.lease;
        w.traffic = batch.traffic;
        w.keep = batch.keep;
    }
    windows.front().checksums = std::move(batch.checksums);  // none on UCX (computed before)
    return windows;
}

bool PacedPath::may_post(const Queued& item, double now) const {
    if (item.handoff) {
        return true;
    }
    if (pacer_->quiet(now, kLinger)) {
        const bool recent = now - pacer_->handoff_ended < kRecent;
        return item.in_flight < (recent ? kWindowsInFlightNearHandoffs : kWindowsInFlight);
    }
    return item.in_flight == 0 && now - item.waiting_since >= kStarved;
}

void PacedPath::post_window(const std::shared_ptr<Queued>& item, double now) {
    PathBatch window = std::move(item->windows.front());
    item->windows.pop_front();
    ++item->in_flight;
    if (item->handoff) {
        ++pacer_->handoffs_in_flight;
    } else {
        item->waiting_since = now;
    }
    // Recorded only: this may run inside a UCX callback (transport/path.h).
    inner_->post(std::move(window), [item, pacer = pacer_](const PortOutcome& outcome) {
        --item->in_flight;
        if (item->handoff) {
            --pacer->handoffs_in_flight;
            pacer->handoff_ended = steady_seconds();
        }
        if (!outcome.ok && item->outcome.ok) {
            item->outcome = outcome;
        }
    });
}

void PacedPath::pump(double now) {
    while (!queue_.empty()) {
        const std::shared_ptr<Queued> item = queue_.front();
        if (!item->outcome.ok) {
            item->windows.clear();  // one window failed: the rest would not help
        }
        while (!item->windows.empty() && may_post(*item, now)) {
            post_window(item, now);
        }
        if (!item->windows.empty() || item->in_flight > 0) {
            return;
        }
        queue_.pop_front();
        item->done(item->outcome);
    }
}

bool PacedPath::poll(double now) {
    pump(now);
    const bool inner = inner_->poll(now);
    return inner || !queue_.empty();
}

double PacedPath::next_deadline() const {
    double next = inner_->next_deadline();
    if (!queue_.empty() && !queue_.front()->windows.empty() && !queue_.front()->handoff) {
        // the linger's end, or a window goes at the latest when a class starves
        next = std::min(next, pacer_->handoffs_in_flight == 0 && !pacer_->held
                                  ? pacer_->handoff_ended + kLinger
                                  : queue_.front()->waiting_since + kStarved);
    }
    return next;
}

// Marked only (this may run inside UCX's error callback): poll() completes them failed.
void PacedPath::cancel() {
    for (const auto& item : queue_) {
        item->windows.clear();
        if (item->outcome.ok) {
            item->outcome = outcome_of(UCS_ERR_CANCELED);
        }
    }
    inner_->cancel();
}

void PacedPath::cancel_lease(uint64_t lease) {
    for (const auto& item : queue_) {
        if (item->lease == lease) {
            item->windows.clear();
            if (item->outcome.ok) {
                item->outcome = outcome_of(UCS_ERR_CANCELED);
            }
        }
    }
    inner_->cancel_lease(lease);
}

void PacedPath::close(bool force, double timeout_seconds) {
    cancel();
    inner_->close(force, timeout_seconds);
}

}  // namespace kvmove
