#include <pybind11/stl.h>

#include "bindings.h"
#include "common/errors.h"
#include "cuda/cuda_status.h"
#include "transport/ucx.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_runtime(py::module_& m) {
    m.def("ucx_version", &ucx_version, "Version of the libucp this process loaded.");
    m.def(
        "cuda_status",
        [] {
            CudaStatus s = cuda_status();
            return py::make_tuple(s.built, s.device_count, s.reason);
        },
        "(built with CUDA, device count, reason when 0).");
    m.def("check_timeout", &check_timeout, py::arg("timeout"),
          "Raises ConfigError unless timeout is in [0, 1e6] seconds (every wait's rule).");
}

}  // namespace kvmove::bindings
