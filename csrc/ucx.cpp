#include "ucx.h"

#include <ucp/api/ucp.h>

namespace kvmove {

std::string ucx_version() { return ucp_get_version_string(); }

}  // namespace kvmove
