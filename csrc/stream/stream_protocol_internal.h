// Helpers the stream protocol's files share (stream_protocol.cpp, stream_sender.cpp,
// stream_receiver.cpp): how a stream is named in messages, and the request id's bounds.
#pragma once

#include <limits>
#include <string>

#include "common/errors.h"
#include "stream/stream_message.h"

namespace kvmove {

constexpr double kNoDeadline = std::numeric_limits<double>::infinity();
// How often a quarantined lease's sender is checked for having exited.
constexpr double kQuarantinePollSeconds = 0.05;
// How often a quarantined lease's sender, a live peer again, is asked to cancel it.
constexpr double kQuarantineCancelSeconds = 0.5;

inline std::string describe(const std::string& request_id, const std::string& peer) {
    return "request '" + request_id + "' with '" + peer + "'";
}

inline void check_request_id(const std::string& request_id) {
    KVMOVE_CHECK(
        !request_id.empty() && request_id.size() <= kMaxRequestIdBytes, Config,
        "request_id must be 1.." << kMaxRequestIdBytes << " bytes, got " << request_id.size());
}

}  // namespace kvmove
