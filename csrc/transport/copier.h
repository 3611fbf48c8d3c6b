// Copier: the threads that run the memcpys of transfers to mapped same-host peers.
//
// A CopyJob is one transfer's byte ranges, cut into chunks of about kChunkBytes (long ranges
// split, short ones grouped), so several threads share one large transfer, and a cancelled
// job stops within one chunk per thread. A job is done once every chunk was copied or, after
// cancel(), skipped.
//
// Each job has a traffic class; jobs of one class run in submission order. A hand-off's jobs
// run on the urgent threads. The other classes (prefetch before offload) run on as many
// background threads, which the kernel schedules as SCHED_IDLE: they take only CPU time no
// other thread wants, so an offload never delays the threads a hand-off needs (its copies,
// the agents' progress, the receiver's checks, the engine) on a busy machine. They keep off
// while a hand-off is under way: its copies run, or a stream of it waits for its receiver's
// answer (hold_background), and for kLinger after. Neither waits for ever: a class that
// started no chunk for kStarved gets one on an urgent thread while hand-offs keep coming (one
// per kStarved, as a paced UCX path lets one window go), and all of its chunks while none
// waits (its background threads get no CPU: a machine busy with other work).
// (Measured by kvmove-bench classes; docs/transfer.md, "Traffic classes".)

#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/cpu_mask.h"

namespace kvmove {

// What a transfer is for, most urgent first (Agent::write's `traffic`).
enum class TrafficClass : uint8_t { Handoff = 0, Prefetch = 1, Offload = 2 };
constexpr size_t kTrafficClasses = 3;

struct CopyOp {
    char* dst;
    const char* src;
    uint64_t nbytes;
};

// A checksum a copy job computes beside its copies: XXH3 of [src, src + nbytes), seeded,
// written to *out (common/hash.h). The job's copy threads share these too, a chunk of them
// after each chunk of copies, while the bytes just copied are still in the CPU's caches.
struct HashOp {
    const char* src;
    uint64_t nbytes;
    uint64_t seed;
    uint64_t* out;
};

class CopyJob {
public:
    // keep_alive: what the pointers point into (a peer's mapping, the checksums' outputs),
    // held until the job dies. hashes: done with the copies (done() once both are).
    CopyJob(const std::vector<CopyOp>& ops, std::shared_ptr<const void> keep_alive,
            std::function<void()> on_done, const std::vector<HashOp>& hashes = {});
    CopyJob(const CopyJob&) = delete;
    CopyJob& operator=(const CopyJob&) = delete;

    uint64_t nbytes() const { return nbytes_; }
    bool done() const { return done_.load(std::memory_order_acquire); }
    bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }
    // The chunks not yet started are skipped; done() once the running ones end.
    void cancel() { cancelled_.store(true, std::memory_order_relaxed); }
    // Runs the next chunk; false when none was left to take.
    bool run_chunk();
    void run_all() {
        while (run_chunk()) {
        }
    }

private:
    // A chunk: pieces_[first, end) to copy, then hashes_[first_hash, end_hash) to compute.
    struct Chunk {
        size_t end;
        size_t end_hash;
    };

    std::vector<CopyOp> pieces_;
    std::vector<HashOp> hashes_;
    std::vector<Chunk> chunks_;  // chunk i starts where chunk i-1 ended
    std::shared_ptr<const void> keep_alive_;
    std::function<void()> on_done_;
    uint64_t nbytes_ = 0;
    std::atomic<size_t> next_{0};
    std::atomic<size_t> left_;
    std::atomic<bool> cancelled_{false};
    std::atomic<bool> done_{false};
};

// The copy threads an agent starts when its copy_threads setting is 0: one per two CPUs, 2
// to 4 (agent_peers.cpp says why).
int default_copy_threads();

// The machine's copy limit as kvmove's mapped path sees it: the best of `repeats` copies of
// nbytes between two buffers of this process, by a Copier of `threads` threads (0: the
// default) with the mapped path's kernel and chunking; GB/s. What a same-host transfer can
// reach at best, so "% of this" reads as overhead (kvmove-bench transfer).
double copy_limit_gbytes_per_s(uint64_t nbytes, int threads, int repeats);

class Copier {
public:
    // num_threads urgent and as many background threads, on `cpus` (those of the thread that
    // built the agent, not of the one whose first mapped put started them).
    Copier(int num_threads, CpuMask cpus);
    // Cancels what is queued and joins the threads.
    ~Copier();
    Copier(const Copier&) = delete;
    Copier& operator=(const Copier&) = delete;

    void submit(std::shared_ptr<CopyJob> job, TrafficClass traffic = TrafficClass::Handoff);
    // Whether a hand-off is under way with no copy of it running (a stream waits for its
    // receiver's answer): background threads keep off as while its copies run, and for
    // kLinger after it is no longer held.
    void hold_background(bool held);

    // How long a waiting class may go without starting a chunk before the urgent threads run
    // one (while hand-offs wait) or its chunks (while none does: its background threads get
    // no CPU, the machine is busy).
    static constexpr std::chrono::milliseconds kStarved{20};
    // How long background threads keep off after a hand-off's copies ended.
    static constexpr std::chrono::microseconds kLinger{1000};

private:
    using Clock = std::chrono::steady_clock;
    static constexpr size_t kUrgent = 0;  // TrafficClass::Handoff

    void loop(bool background);
    // Under mu_: the class whose job the calling thread runs a chunk of next, or
    // kTrafficClasses for none (it waits).
    size_t pick(bool background, Clock::time_point now);
    // Under mu_: whether a class less urgent than a hand-off has a job queued.
    bool waiting_below_urgent() const;

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<CopyJob>> queues_[kTrafficClasses];  // by TrafficClass
    bool held_ = false;                                             // hold_background()
    // When a background thread last started a chunk of it (or it began to wait).
    Clock::time_point background_start_[kTrafficClasses] = {};
    int urgent_running_ = 0;          // hand-off chunks being copied now
    Clock::time_point urgent_ended_;  // when the last one ended
    bool stop_ = false;
    std::vector<std::thread> threads_;
};

}  // namespace kvmove
