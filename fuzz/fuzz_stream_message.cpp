// libFuzzer target: layer-stream messages (csrc/stream/stream_message.h), the data of every
// active message a peer sends. Whatever the input, decode_stream_message() returns or throws
// kvmove::Error; a message it accepts encodes back to exactly itself.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/errors.h"
#include "stream/stream_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    kvmove::StreamMessage message;
    try {
        message = kvmove::decode_stream_message(data, size);
    } catch (const kvmove::Error&) {
        return 0;
    }
    const std::string again = kvmove::encode(message);
    if (again.size() != size ||
        again.compare(0, size, reinterpret_cast<const char*>(data), size) != 0) {
        std::abort();  // accepted, but not as it would be written
    }
    return 0;
}
