#include "storage/io_threads.h"

#include "common/errors.h"

namespace kvmove {

IoThreads::IoThreads(int num_threads) {
    KVMOVE_CHECK(num_threads > 0, Config, "need at least one I/O thread, got " << num_threads);
    threads_.reserve(static_cast<size_t>(num_threads));
    for (int i = 0; i < num_threads; ++i) {
        threads_.emplace_back([this] { loop(); });
    }
}

IoThreads::~IoThreads() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
    }
    ready_.notify_all();
    for (auto& t : threads_) {
        t.join();
    }
}

void IoThreads::enqueue(std::function<void()> task) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(task));
    }
    ready_.notify_one();
}

void IoThreads::loop() {
    for (;;) {
        std::function<void()> task;
        {
            std::unique_lock<std::mutex> lock(mu_);
            // Not a timed wait: an idle pool has nothing to time out, and the destructor wakes it.
            ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) {
                return;  // stopping, and every queued task ran
            }
            task = std::move(queue_.front());
            queue_.pop_front();
        }
        task();  // a packaged_task: what it throws goes to its future
    }
}

}  // namespace kvmove
