#include "common/log.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>

namespace kvmove {

namespace {

struct LogQueue {
    std::mutex mu;
    std::condition_variable ready;
    std::deque<LogRecord> records;
    uint64_t dropped = 0;
};

// Never destroyed: core threads may still log while the process exits.
LogQueue& queue() {
    static LogQueue* q = new LogQueue();
    return *q;
}

std::atomic<int> threshold{static_cast<int>(LogLevel::Warning)};

}  // namespace

void set_log_level(int level) {
    threshold = level;
}

bool log_enabled(LogLevel level) {
    return static_cast<int>(level) >= threshold.load(std::memory_order_relaxed);
}

void log_message(LogLevel level, const char* logger, std::string message) {
    LogQueue& q = queue();
    {
        std::lock_guard<std::mutex> lock(q.mu);
        if (q.records.size() >= kMaxLogRecords) {
            q.records.pop_front();
            ++q.dropped;
        }
        q.records.push_back({static_cast<int>(level), logger, std::move(message)});
    }
    q.ready.notify_one();
}

std::vector<LogRecord> take_log(double timeout_seconds, size_t max_records) {
    LogQueue& q = queue();
    std::unique_lock<std::mutex> lock(q.mu);
    q.ready.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
                     [&] { return !q.records.empty(); });
    std::vector<LogRecord> out;
    while (!q.records.empty() && out.size() < max_records) {
        out.push_back(std::move(q.records.front()));
        q.records.pop_front();
    }
    return out;
}

uint64_t log_dropped() {
    std::lock_guard<std::mutex> lock(queue().mu);
    return queue().dropped;
}

}  // namespace kvmove
