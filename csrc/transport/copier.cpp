#include "transport/copier.h"

#include <algorithm>
#include <cstring>

namespace kvmove {

namespace {

// Large enough that a chunk costs far more than taking it (an atomic add), small enough that
// two threads share a 16 MiB layer run and a cancel takes effect within ~0.1 ms.
constexpr uint64_t kChunkBytes = uint64_t{1} << 20;

}  // namespace

CopyJob::CopyJob(const std::vector<CopyOp>& ops, std::shared_ptr<const void> keep_alive,
                 std::function<void()> on_done)
    : keep_alive_(std::move(keep_alive)), on_done_(std::move(on_done)) {
    uint64_t in_chunk = 0;
    for (const CopyOp& op : ops) {
        nbytes_ += op.nbytes;
        for (uint64_t at = 0; at < op.nbytes;) {
            const uint64_t n = std::min(op.nbytes - at, kChunkBytes - in_chunk);
            pieces_.push_back({op.dst + at, op.src + at, n});
            at += n;
            in_chunk += n;
            if (in_chunk == kChunkBytes) {
                chunk_ends_.push_back(pieces_.size());
                in_chunk = 0;
            }
        }
    }
    if (chunk_ends_.empty() || chunk_ends_.back() != pieces_.size()) {
        chunk_ends_.push_back(pieces_.size());  // the last, partial chunk (or the empty job's)
    }
    left_.store(chunk_ends_.size());
}

bool CopyJob::run_chunk() {
    const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= chunk_ends_.size()) {
        return false;
    }
    if (!cancelled()) {
        for (size_t p = i == 0 ? 0 : chunk_ends_[i - 1]; p < chunk_ends_[i]; ++p) {
            std::memcpy(pieces_[p].dst, pieces_[p].src, pieces_[p].nbytes);
        }
    }
    if (left_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        done_.store(true, std::memory_order_release);
        if (on_done_) {
            on_done_();
        }
    }
    return true;
}

Copier::Copier(int num_threads) {
    for (int i = 0; i < std::max(num_threads, 1); ++i) {
        threads_.emplace_back([this] { loop(); });
    }
}

Copier::~Copier() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        for (const auto& job : queue_) {
            job->cancel();
        }
    }
    cv_.notify_all();
    for (std::thread& t : threads_) {
        t.join();
    }
}

void Copier::submit(std::shared_ptr<CopyJob> job) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(job));
    }
    cv_.notify_all();
}

void Copier::loop() {
    while (true) {
        std::shared_ptr<CopyJob> job;
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
            if (stop_) {
                return;
            }
            job = queue_.front();
        }
        if (!job->run_chunk()) {
            std::lock_guard<std::mutex> lock(mu_);
            if (!queue_.empty() && queue_.front() == job) {
                queue_.pop_front();  // every chunk taken: the next job's turn
            }
        }
    }
}

}  // namespace kvmove
