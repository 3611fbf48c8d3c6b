// UCX: what kvmove knows about the UCX library it runs on.
#pragma once

#include <string>

namespace kvmove {

// The version of the libucp actually loaded, e.g. "1.22.0".
std::string ucx_version();

}  // namespace kvmove
