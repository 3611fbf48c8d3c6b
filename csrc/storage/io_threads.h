// IoThreads: a fixed set of threads that run queued blocking calls (pread, pwrite), so that
// one caller keeps several of them in flight.
//
// Why threads and not io_uring: the disk tier's requests are large (2-16 MiB, O_DIRECT), a few
// hundred per 500 MB, so a context switch per request costs nothing measurable, while
// io_uring would need liburing (not on a fresh machine) or raw syscalls with a fallback for
// kernels and sandboxes (seccomp) that refuse it. The threads are started once per owner;
// std::async would start one per request.
//
// submit() returns a std::future: callers wait with a deadline (future::wait_for). A task
// still running when its waiter gives up keeps running; the destructor runs every queued task
// and joins, so an owner declares its buffers before its IoThreads and they outlive the tasks.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvmove {

class IoThreads {
public:
    explicit IoThreads(int num_threads);
    ~IoThreads();
    IoThreads(const IoThreads&) = delete;
    IoThreads& operator=(const IoThreads&) = delete;

    int num_threads() const { return static_cast<int>(threads_.size()); }

    // Queues fn to run on one of the threads; its result (or exception) arrives in the future.
    template <class F>
    auto submit(F fn) -> std::future<std::invoke_result_t<F>> {
        using Result = std::invoke_result_t<F>;
        auto task = std::make_shared<std::packaged_task<Result()>>(std::move(fn));
        auto future = task->get_future();
        enqueue([task] { (*task)(); });
        return future;
    }

private:
    void enqueue(std::function<void()> task);
    void loop();

    std::mutex mu_;
    std::condition_variable ready_;
    std::deque<std::function<void()>> queue_;
    bool stopping_ = false;
    std::vector<std::thread> threads_;
};

}  // namespace kvmove
