// The core's log: records go to a bounded queue that the Python side drains into its
// `logging` (logger "kvmove.<name>", kvmove/_log.py), so KVMOVE_LOG_LEVEL and logging's
// handlers decide what is shown, for C++ and Python alike.
//
// Why a queue and not a call into Python: records come from the core's own threads (the
// progress thread, UCX callbacks) while they hold the agent's worker lock; taking the GIL
// there could deadlock against a Python thread that holds the GIL and waits for that lock.
// Logging never blocks: a full queue drops the oldest record and counts it.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace kvmove {

// Python logging's levels.
enum class LogLevel : int { Debug = 10, Info = 20, Warning = 30, Error = 40 };

struct LogRecord {
    int level;
    std::string logger;  // "stream", "agent", "ucx"...
    std::string message;
};

constexpr size_t kMaxLogRecords = 10000;

// Records below it are dropped where they are made (default Warning).
void set_log_level(int level);
bool log_enabled(LogLevel level);
void log_message(LogLevel level, const char* logger, std::string message);
// Waits up to timeout_seconds for records; returns those queued (at most max_records).
std::vector<LogRecord> take_log(double timeout_seconds, size_t max_records);
// Records dropped because the queue was full, since the process started.
uint64_t log_dropped();

}  // namespace kvmove

// KVMOVE_LOG(Warning, "stream", "dropped a message from '" << peer << "'"): formats only when
// the level is enabled.
#define KVMOVE_LOG(level, logger, stream_expr)                                              \
    do {                                                                                    \
        if (::kvmove::log_enabled(::kvmove::LogLevel::level)) {                             \
            std::ostringstream kvmove_log_os_;                                              \
            kvmove_log_os_ << stream_expr;                                                  \
            ::kvmove::log_message(::kvmove::LogLevel::level, logger, kvmove_log_os_.str()); \
        }                                                                                   \
    } while (0)

// KVMOVE_LOG_AT(level_value, ...): the same, with the level a runtime LogLevel.
#define KVMOVE_LOG_AT(level_value, logger, stream_expr)                             \
    do {                                                                            \
        const ::kvmove::LogLevel kvmove_log_level_ = (level_value);                 \
        if (::kvmove::log_enabled(kvmove_log_level_)) {                             \
            std::ostringstream kvmove_log_os_;                                      \
            kvmove_log_os_ << stream_expr;                                          \
            ::kvmove::log_message(kvmove_log_level_, logger, kvmove_log_os_.str()); \
        }                                                                           \
    } while (0)
