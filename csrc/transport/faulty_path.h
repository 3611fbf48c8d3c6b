// FaultyPath: any path (transport/path.h) with faults injected where kvmove posts, as
// transport/faults.h configures them: the only place the data path knows about fault
// injection. The Agent wraps each peer's path in one when its config asks for faults.
//
//   post  fail_post: fails the batch at once, nothing posted; corrupt_every: a stream layer's
//         first byte lands flipped (the batch's first range is split around it, so no two
//         writes race for it), which the checksums must catch
//   send  drop_message: reported as sent, never sent; delay_message_ms: held, then sent in
//         order by poll(); rndv_messages: sent as rendezvous, which receivers must drop
//
// delay_post_us is the stream protocol's (Agent::post_delay_seconds): it sleeps off the lock.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/faults.h"
#include "transport/path.h"

namespace kvmove {

class FaultyPath : public WrappingPath {
public:
    // host_memory: the agent's cache is in host memory (a device's is never corrupted here).
    FaultyPath(std::unique_ptr<Path> inner, FaultInjector& faults, bool host_memory);

    void post(PathBatch batch, PathDone done) override;
    void send(unsigned am_id, std::string message, bool rendezvous, PathDone done) override;
    bool poll(double now) override;
    double next_deadline() const override;
    void close(bool force, double timeout_seconds) override;

private:
    struct Held {
        double due;
        unsigned am_id;
        std::string message;
        PathDone done;
    };
    void corrupt(PathBatch& batch, PathDone& done);

    FaultInjector& faults_;
    const bool host_memory_;
    std::deque<Held> held_;  // delayed messages, in order (one delay for all)
};

}  // namespace kvmove
