#include "transport/faulty_path.h"

#include "stream/layer_stream.h"

namespace kvmove {

FaultyPath::FaultyPath(std::unique_ptr<Path> inner, FaultInjector& faults, bool host_memory)
    : WrappingPath(std::move(inner)), faults_(faults), host_memory_(host_memory) {}

void FaultyPath::post(PathBatch batch, PathDone done) {
    if (faults_.fail_post()) {
        done({false, ErrorKind::Transfer, "posting failed (injected fault)"});
        return;
    }
    if (batch.lease != 0 && host_memory_ && !batch.ranges.empty() && faults_.corrupt_layer()) {
        corrupt(batch, done);
    }
    inner_->post(std::move(batch), std::move(done));
}

// The first byte of the batch goes from a flipped copy held until the batch is done; the rest
// of its range as it was. The two pieces do not overlap, so they land in any order.
void FaultyPath::corrupt(PathBatch& batch, PathDone& done) {
    RangePair& first = batch.ranges.front();
    auto flipped = std::make_shared<uint8_t>(*reinterpret_cast<const uint8_t*>(first.here) ^ 0xFF);
    RangePair byte = first;
    byte.here = reinterpret_cast<uint64_t>(flipped.get());
    byte.nbytes = 1;
    ++first.here;
    ++first.there;
    --first.nbytes;
    batch.ranges.insert(batch.ranges.begin(), byte);
    done = [flipped, done = std::move(done)](const PortOutcome& o) { done(o); };
}

void FaultyPath::send(unsigned am_id, std::string message, bool rendezvous, PathDone done) {
    if (faults_.drop_message()) {
        done({});  // lost on the way, as far as the sender can tell
        return;
    }
    if (const double delay = faults_.message_delay_seconds(); delay > 0) {
        held_.push_back({steady_seconds() + delay, am_id, std::move(message), std::move(done)});
        return;
    }
    inner_->send(am_id, std::move(message), rendezvous || faults_.rndv_message(), std::move(done));
}

// Sends the held messages that are due.
bool FaultyPath::poll(double now) {
    while (!held_.empty() && held_.front().due <= now) {
        Held held = std::move(held_.front());
        held_.pop_front();
        inner_->send(held.am_id, std::move(held.message), faults_.rndv_message(),
                     std::move(held.done));
    }
    const bool inner_pending = inner_->poll(now);
    return inner_pending || !held_.empty();
}

double FaultyPath::next_deadline() const {
    const double inner = inner_->next_deadline();
    return held_.empty() ? inner : std::min(inner, held_.front().due);
}

void FaultyPath::close(bool force, double timeout_seconds) {
    for (Held& held : held_) {  // never sent now
        held.done({false, ErrorKind::Peer, "the connection closed before the held message"});
    }
    held_.clear();
    inner_->close(force, timeout_seconds);
}

}  // namespace kvmove
