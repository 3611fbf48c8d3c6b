#include <pybind11/stl.h>

#include "bindings.h"
#include "common/errors.h"
#include "common/log.h"
#include "cuda/cuda_status.h"
#include "transport/ucx.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_runtime(py::module_& m) {
    m.def("ucx_version", &ucx_version, "Version of the libucp this process loaded.");
    m.def("peer_error_settings", &peer_error_settings,
          "(key without UCX_, value) pairs an agent adds to UCX's config in PEER error mode.");
    m.def(
        "cuda_status",
        [] {
            CudaStatus s = cuda_status();
            return py::make_tuple(s.built, s.device_count, s.reason);
        },
        "(built with CUDA, device count, reason when 0).");
    m.def("check_timeout", &check_timeout, py::arg("timeout"),
          "Raises ConfigError unless timeout is in [0, 1e6] seconds (every wait's rule).");
    m.def("set_log_level", &set_log_level, py::arg("level"),
          "The core's records below this logging level are dropped where they are made.");
    // Never waits, and keeps the GIL: a daemon thread that waited in here with the GIL
    // released would be ended by Python's shutdown (pthread_exit) inside C++ frames, which
    // terminates the process.
    m.def(
        "take_log",
        [](size_t max_records) {
            std::vector<LogRecord> records = take_log(0, max_records);
            py::list out;
            for (const LogRecord& r : records) {
                out.append(py::make_tuple(r.level, r.logger, r.message));
            }
            return out;
        },
        py::arg("max_records") = 1000, "(level, logger, message) records the core queued.");
    m.def("log_dropped", &log_dropped, "Core log records dropped on a full queue.");
}

}  // namespace kvmove::bindings
