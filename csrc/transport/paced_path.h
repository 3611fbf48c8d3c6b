// PacedPath: a UCX path (transport/ucx_path.h) on which a prefetch or an offload gives way to
// hand-offs (copier.h says the same for the mapped path's copies).
//
// UCX carries what is posted on it in its own order: an offload of hundreds of MiB posted on
// one endpoint shares the link with a hand-off posted on another one, and halves it (measured
// over tcp: a 16 MiB hand-off 1.8x slower beside an offload stream). So a batch of a less
// urgent class is not posted whole: it is cut into windows of kWindowBytes, and a window is
// posted only while no hand-off is in flight on any of the agent's paced paths (the Pacer
// they share counts them), no stream of the agent waits for its receiver's Go or Ack, and for
// kLinger after. Four windows go at once, but one within 100 ms of a hand-off: a hand-off
// that starts waits for what is in flight (over tcp on two cores, 4 MiB ahead of a 16 MiB
// hand-off made it 2-2.6x slower than alone, 1 MiB 1.0-2.0x).
// Neither waits for ever: a batch that got no window out for kStarved gets one.
//
// A path keeps its promises (transport/path.h): its batches, of every class, complete in
// posting order (a hand-off posted behind an offload to the same peer waits for it; across
// peers it goes first), and messages are not held.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/path.h"

namespace kvmove {

// What an agent's paced paths share: hand-off batches in flight on them, and when the last
// landed.
struct Pacer {
    int handoffs_in_flight = 0;
    double handoff_ended = 0;  // when the last hand-off batch landed (or stopped being held)
    bool held = false;         // a hand-off waits for its receiver's answer (Agent sets it)

    bool quiet(double now, double linger) const {
        return handoffs_in_flight == 0 && !held && now - handoff_ended >= linger;
    }
};

class PacedPath : public WrappingPath {
public:
    static constexpr uint64_t kWindowBytes = uint64_t{1} << 20;
    static constexpr double kStarved = 0.02;  // seconds
    // How long windows keep off after a hand-off batch landed: a stream's next layer follows.
    static constexpr double kLinger = 0.001;

    PacedPath(std::unique_ptr<Path> inner, std::shared_ptr<Pacer> pacer);

    void post(PathBatch batch, PathDone done) override;
    bool poll(double now) override;
    double next_deadline() const override;
    void cancel() override;
    void cancel_lease(uint64_t lease) override;
    void close(bool force, double timeout_seconds) override;

private:
    // One batch while it is queued here or its windows are under way.
    struct Queued {
        std::deque<PathBatch> windows;  // not yet posted, in order (a hand-off: one, whole)
        PathDone done;
        uint64_t lease;
        bool handoff;
        int in_flight = 0;     // its windows posted and not yet landed
        double waiting_since;  // queued, or its last window posted
        PortOutcome outcome;
    };

    // Posts what may go now, completes what landed, in posting order. Outside UCX callbacks.
    void pump(double now);
    bool may_post(const Queued& item, double now) const;
    void post_window(const std::shared_ptr<Queued>& item, double now);
    static std::deque<PathBatch> cut(PathBatch batch);

    std::shared_ptr<Pacer> pacer_;
    std::deque<std::shared_ptr<Queued>> queue_;  // in posting order
};

}  // namespace kvmove
