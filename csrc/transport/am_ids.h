// The UCX active-message ids an agent sends and handles.
#pragma once

namespace kvmove {

constexpr unsigned kNotifyAmId = 0x4B56;  // "KV": notifications of plain transfers
constexpr unsigned kStreamAmId = 0x4B57;  // layer stream messages (stream/stream_message.h)
constexpr unsigned kHelloAmId = 0x4B58;   // a connecting agent's first word (Join::Connect)

}  // namespace kvmove
