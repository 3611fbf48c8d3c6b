#include "transport/copier.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

#include "common/errors.h"
#include "common/hash.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvmove {

namespace {

// Large enough that a chunk costs far more than taking it (an atomic add), small enough that
// two threads share a 16 MiB layer run and a cancel takes effect within ~0.1 ms.
constexpr uint64_t kChunkBytes = uint64_t{1} << 20;
// Pieces from this size on are copied with non-temporal stores (below).
constexpr uint64_t kStreamMinBytes = 16 * 1024;

// memcpy with non-temporal (streaming) stores: the destination lines are written without
// being read first, and bypass our caches (the bytes are for another process anyway). glibc's
// memcpy switches to such stores only above a threshold that a 1 MiB chunk never reaches, and
// that cost the mapped path half its speed. Measured here (2-core EPYC, 512 MiB in 1 MiB
// chunks): memcpy 2.9-3.9 GB/s, this 5.4-5.7 GB/s, one 512 MiB memcpy 4.9-5.3 GB/s. The sfence
// orders the streaming stores before whatever says the copy is done.
void stream_copy(char* dst, const char* src, uint64_t nbytes) {
#if defined(__SSE2__)
    const uint64_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    std::memcpy(dst, src, head);  // to a cache-line boundary (nbytes >= kStreamMinBytes > 64)
    dst += head;
    src += head;
    nbytes -= head;
    for (; nbytes >= 64; nbytes -= 64, dst += 64, src += 64) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    std::memcpy(dst, src, nbytes);
    _mm_sfence();
#else
    std::memcpy(dst, src, nbytes);
#endif
}

void copy(const CopyOp& op) {
    if (op.nbytes >= kStreamMinBytes) {
        stream_copy(op.dst, op.src, op.nbytes);
    } else {
        std::memcpy(op.dst, op.src, op.nbytes);
    }
}

}  // namespace

CopyJob::CopyJob(const std::vector<CopyOp>& ops, std::shared_ptr<const void> keep_alive,
                 std::function<void()> on_done, const std::vector<HashOp>& hashes)
    : hashes_(hashes), keep_alive_(std::move(keep_alive)), on_done_(std::move(on_done)) {
    uint64_t in_chunk = 0;
    for (const CopyOp& op : ops) {
        nbytes_ += op.nbytes;
        for (uint64_t at = 0; at < op.nbytes;) {
            const uint64_t n = std::min(op.nbytes - at, kChunkBytes - in_chunk);
            pieces_.push_back({op.dst + at, op.src + at, n});
            at += n;
            in_chunk += n;
            if (in_chunk == kChunkBytes) {
                chunks_.push_back({pieces_.size(), 0});
                in_chunk = 0;
            }
        }
    }
    if (chunks_.empty() || chunks_.back().end != pieces_.size()) {
        chunks_.push_back({pieces_.size(), 0});  // the last, partial chunk (or the empty job's)
    }
    // The hashes go with the copy chunks, in order and in proportion (the bytes a chunk
    // copies are still in the caches for the hashes after it); a hash is never split.
    uint64_t total = 0;
    for (const HashOp& h : hashes_) {
        total += h.nbytes;
    }
    const size_t n = chunks_.size();
    size_t next = 0;
    uint64_t hashed = 0;
    for (size_t i = 0; i < n; ++i) {
        const uint64_t due = i + 1 == n ? total : total / n * (i + 1);  // by the end of chunk i
        while (next < hashes_.size() && hashed < due) {
            hashed += hashes_[next++].nbytes;
        }
        chunks_[i].end_hash = next;
    }
    left_.store(chunks_.size());
}

bool CopyJob::run_chunk() {
    const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= chunks_.size()) {
        return false;
    }
    if (!cancelled()) {
        for (size_t p = i == 0 ? 0 : chunks_[i - 1].end; p < chunks_[i].end; ++p) {
            copy(pieces_[p]);
        }
        for (size_t h = i == 0 ? 0 : chunks_[i - 1].end_hash; h < chunks_[i].end_hash; ++h) {
            const HashOp& op = hashes_[h];
            *op.out = xxh3(op.src, op.nbytes, op.seed);
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

Copier::Copier(int num_threads, CpuMask cpus) {
    for (int i = 0; i < 2 * std::max(num_threads, 1); ++i) {
        const bool background = i % 2 == 1;
        threads_.emplace_back([this, cpus, background] {
            cpus.apply();
            if (background) {  // best effort: where the kernel refuses, it stays as it is
                sched_param param{};
                pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);
            }
            loop(background);
        });
    }
}

Copier::~Copier() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        for (const auto& queue : queues_) {
            for (const auto& job : queue) {
                job->cancel();
            }
        }
    }
    cv_.notify_all();
    for (std::thread& t : threads_) {
        t.join();
    }
}

void Copier::submit(std::shared_ptr<CopyJob> job, TrafficClass traffic) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto& queue = queues_[static_cast<size_t>(traffic)];
        if (queue.empty()) {
            background_start_[static_cast<size_t>(traffic)] = Clock::now();  // waiting from now
        }
        queue.push_back(std::move(job));
    }
    cv_.notify_all();
}

void Copier::hold_background(bool held) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (held_ && !held) {
            urgent_ended_ = Clock::now();  // the linger starts
        }
        held_ = held;
    }
    cv_.notify_all();
}

size_t Copier::pick(bool background, Clock::time_point now) {
    // Background threads keep off while hand-off copies run, and for kLinger after: the
    // hand-off's next steps (its checks, its next layer) follow soon.
    const bool quiet = !held_ && urgent_running_ == 0 && queues_[kUrgent].empty() &&
                       now - urgent_ended_ >= kLinger;
    for (size_t c = kUrgent + 1; c < kTrafficClasses; ++c) {
        if (queues_[c].empty()) {
            continue;
        }
        if (background) {
            return quiet ? c : kTrafficClasses;  // the most urgent of the background classes
        }
        if (now - background_start_[c] >= kStarved) {
            if (held_ || !queues_[kUrgent].empty()) {
                background_start_[c] = now;  // a hand-off is under way: one chunk per kStarved
            }
            // (else its background threads get no CPU: urgent threads do it meanwhile)
            return c;
        }
    }
    return background || queues_[kUrgent].empty() ? kTrafficClasses : kUrgent;
}

bool Copier::waiting_below_urgent() const {
    for (size_t c = kUrgent + 1; c < kTrafficClasses; ++c) {
        if (!queues_[c].empty()) {
            return true;
        }
    }
    return false;
}

void Copier::loop(bool background) {
    while (true) {
        std::shared_ptr<CopyJob> job;
        size_t traffic = kTrafficClasses;
        {
            std::unique_lock<std::mutex> lock(mu_);
            while (!stop_ && (traffic = pick(background, Clock::now())) == kTrafficClasses) {
                if (!waiting_below_urgent()) {
                    cv_.wait(lock);
                } else if (background) {  // until the hand-off's copies end, then the linger
                    if (held_ || urgent_running_ > 0 || !queues_[kUrgent].empty()) {
                        cv_.wait(lock);
                    } else {
                        cv_.wait_until(lock, urgent_ended_ + kLinger);
                    }
                } else {  // wakes to check whether a background class starves
                    cv_.wait_for(lock, kStarved);
                }
            }
            if (stop_) {
                return;
            }
            if (background) {
                background_start_[traffic] = Clock::now();
            }
            urgent_running_ += traffic == kUrgent ? 1 : 0;
            job = queues_[traffic].front();
        }
        const bool ran = job->run_chunk();
        std::lock_guard<std::mutex> lock(mu_);
        auto& queue = queues_[traffic];
        if (!ran && !queue.empty() && queue.front() == job) {
            queue.pop_front();  // every chunk taken: the next job's turn
        }
        if (traffic == kUrgent) {
            urgent_ended_ = Clock::now();
            if (--urgent_running_ == 0 && queue.empty()) {
                cv_.notify_all();  // background threads: the linger starts
            }
        }
    }
}

int default_copy_threads() {
    const int cpus = static_cast<int>(std::thread::hardware_concurrency());
    return std::clamp(cpus / 2, 2, 4);
}

double copy_limit_gbytes_per_s(uint64_t nbytes, int threads, int repeats) {
    KVMOVE_CHECK(nbytes > 0 && nbytes <= (uint64_t{1} << 40), Config,
                 "nbytes must be in [1, 2**40], got " << nbytes);
    KVMOVE_CHECK(threads >= 0 && threads <= 64, Config,
                 "threads must be in [0, 64], got " << threads);
    KVMOVE_CHECK(repeats >= 1, Config, "repeats must be at least 1, got " << repeats);
    // Touched, so that no copy faults pages in (as numpy's baseline does).
    std::vector<char> src(nbytes, 7);
    std::vector<char> dst(nbytes, 1);
    Copier copier(threads > 0 ? threads : default_copy_threads(), CpuMask::of_this_thread());
    double best = std::numeric_limits<double>::infinity();
    for (int i = 0; i < repeats; ++i) {
        std::mutex mu;
        std::condition_variable cv;
        const auto start = std::chrono::steady_clock::now();
        auto job = std::make_shared<CopyJob>(std::vector<CopyOp>{{dst.data(), src.data(), nbytes}},
                                             nullptr, [&] {
                                                 std::lock_guard<std::mutex> lock(mu);
                                                 cv.notify_all();
                                             });
        copier.submit(job);
        {
            std::unique_lock<std::mutex> lock(mu);
            cv.wait(lock, [&] { return job->done(); });
        }
        best = std::min(
            best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return static_cast<double>(nbytes) / best / 1e9;
}

}  // namespace kvmove
