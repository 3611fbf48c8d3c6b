#include "common/errors.h"

#include <cstring>

namespace kvmove {

const char* error_class_name(ErrorKind kind) {
    switch (kind) {
        case ErrorKind::Config:
            return "ConfigError";
        case ErrorKind::Block:
            return "BlockError";
        case ErrorKind::Allocation:
            return "AllocationError";
        case ErrorKind::Transfer:
            return "TransferError";
        case ErrorKind::Peer:
            return "PeerError";
        case ErrorKind::Metadata:
            return "MetadataError";
        case ErrorKind::Timeout:
            return "TimeoutError";
        case ErrorKind::Ucx:
            return "UCXError";
        case ErrorKind::Cuda:
            return "CudaError";
        case ErrorKind::Store:
            return "StoreError";
        case ErrorKind::Checksum:
            return "ChecksumError";
    }
    return "KVMoveError";
}

void throw_error(ErrorKind kind, const std::string& message, const char* file, int line) {
    const char* base = std::strrchr(file, '/');
    std::ostringstream os;
    os << message << " (" << (base != nullptr ? base + 1 : file) << ":" << line << ")";
    throw Error(kind, os.str());
}

void check_timeout(double timeout_seconds) {
    KVMOVE_CHECK(
        timeout_seconds >= 0 && timeout_seconds <= kMaxTimeoutSeconds, Config,
        "timeout must be in [0, " << kMaxTimeoutSeconds << "] seconds, got " << timeout_seconds);
}

}  // namespace kvmove
