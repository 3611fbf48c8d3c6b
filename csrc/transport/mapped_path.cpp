#include "transport/mapped_path.h"

namespace kvmove {

namespace {

// Batches up to this size are copied by the posting thread at once: handing them to a copy
// thread and waking the progress thread afterwards costs more than the copy (a 32 KiB block
// copies in ~3 us).
constexpr uint64_t kInlineCopyBytes = 256 * 1024;

uint64_t total_nbytes(const std::vector<RangePair>& ranges) {
    uint64_t nbytes = 0;
    for (const RangePair& r : ranges) {
        nbytes += r.nbytes;
    }
    return nbytes;
}

}  // namespace

MappedPath::MappedPath(std::shared_ptr<PeerMapping> mapping, uint32_t pid,
                       std::unique_ptr<UcxPath> messages, std::function<Copier&()> copier,
                       std::function<void()> wake)
    : mapping_(std::move(mapping)),
      pid_(pid),
      messages_(std::move(messages)),
      copier_(std::move(copier)),
      wake_(std::move(wake)) {}

void MappedPath::post(PathBatch batch, PathDone done) {
    std::vector<CopyOp> ops;
    ops.reserve(batch.ranges.size());
    for (const RangePair& r : batch.ranges) {
        char* here = reinterpret_cast<char*>(r.here);
        char* there = mapping_->at(r.there_segment, r.there);
        ops.push_back(batch.direction == Direction::Put ? CopyOp{there, here, r.nbytes}
                                                        : CopyOp{here, there, r.nbytes});
    }
    const bool inline_copy = total_nbytes(batch.ranges) <= kInlineCopyBytes;
    std::shared_ptr<const void> keep = mapping_;
    if (batch.keep) {  // the checksums' outputs as well
        keep =
            std::make_shared<std::pair<std::shared_ptr<const void>, std::shared_ptr<const void>>>(
                mapping_, batch.keep);
    }
    auto job = std::make_shared<CopyJob>(ops, std::move(keep), inline_copy ? nullptr : wake_,
                                         batch.checksums);
    jobs_.push_back({job, std::move(done), batch.lease});
    if (inline_copy) {
        job->run_all();  // done at once: poll() completes it (the agent polls after posting)
    } else {
        copier_().submit(std::move(job), batch.traffic);
    }
}

// Completes the batches whose copies are done, oldest first, as a flush would.
bool MappedPath::poll(double) {
    while (!jobs_.empty() && jobs_.front().job->done()) {
        Posted posted = std::move(jobs_.front());
        jobs_.pop_front();
        // Cancelled: its peer failed or went (a copy thread may have skipped chunks).
        posted.done(outcome_of(posted.job->cancelled() ? UCS_ERR_CANCELED : UCS_OK));
    }
    return !jobs_.empty();
}

// A peer whose process exited fails at once, as UCX's error callback would fail it.
bool MappedPath::alive(std::string& why) const {
    if (mapping_ == nullptr || mapping_->owner_alive()) {
        return true;
    }
    why = "its process " + std::to_string(pid_) + " exited";
    return false;
}

void MappedPath::cancel() {
    for (const Posted& posted : jobs_) {
        posted.job->cancel();
    }
    mapping_.reset();  // unmapped once the copies in flight stop (each job holds it)
}

// A copy thread on a chunk of the lease finishes that chunk (at most 1 MiB each); the rest
// of its jobs are skipped.
void MappedPath::cancel_lease(uint64_t lease) {
    for (const Posted& posted : jobs_) {
        if (posted.lease == lease) {
            posted.job->cancel();
        }
    }
}

void MappedPath::close(bool force, double timeout_seconds) {
    cancel();
    messages_->close(force, timeout_seconds);
}

}  // namespace kvmove
