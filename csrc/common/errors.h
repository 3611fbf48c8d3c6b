// kvmove's error types and check macros: the C++ half of kvmove/errors.py.
//
// Every failure throws a kvmove::Error whose kind() selects the Python class of the same name
// (bindings/module.cpp translates). Messages say what failed, the offending value and the
// limit, and end with the file:line that raised them.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kvmove {

enum class ErrorKind {
    Config,      // a parameter out of range or inconsistent
    Block,       // a block id out of range or in the wrong state
    Allocation,  // the OS or driver refused memory
    Transfer,
    Peer,
    Metadata,  // peer metadata that is truncated, forged or of another version
    Timeout,
    Ucx,
    Cuda,
    Store,     // a storage tier's files are unusable (I/O error, full disk)
    Checksum,  // received bytes do not match the sender's checksums
};

// The name of the Python exception class in kvmove.errors for each kind.
const char* error_class_name(ErrorKind kind);

class Error : public std::runtime_error {
public:
    Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
    ErrorKind kind() const { return kind_; }

private:
    ErrorKind kind_;
};

[[noreturn]] void throw_error(ErrorKind kind, const std::string& message, const char* file,
                              int line);

// Every wait has a deadline: a timeout must be finite and in [0, kMaxTimeoutSeconds].
constexpr double kMaxTimeoutSeconds = 1e6;
void check_timeout(double timeout_seconds);

}  // namespace kvmove

// KVMOVE_CHECK(cond, Kind, "text " << value): throws Error(ErrorKind::Kind) unless cond holds.
#define KVMOVE_CHECK(cond, kind, stream_expr)                                                  \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            std::ostringstream kvmove_check_os_;                                               \
            kvmove_check_os_ << stream_expr;                                                   \
            ::kvmove::throw_error(::kvmove::ErrorKind::kind, kvmove_check_os_.str(), __FILE__, \
                                  __LINE__);                                                   \
        }                                                                                      \
    } while (0)

// KVMOVE_FAIL(Kind, "text " << value): throws unconditionally.
#define KVMOVE_FAIL(kind, stream_expr) KVMOVE_CHECK(false, kind, stream_expr)
