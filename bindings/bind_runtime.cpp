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
    m.def(
        "take_log",
        [](double timeout, size_t max_records) {
            std::vector<LogRecord> records;
            {
                py::gil_scoped_release nogil;
                records = take_log(timeout, max_records);
            }
            py::list out;
            for (const LogRecord& r : records) {
                out.append(py::make_tuple(r.level, r.logger, r.message));
            }
            return out;
        },
        py::arg("timeout"), py::arg("max_records") = 1000,
        "(level, logger, message) records of the core, waiting up to timeout for one.");
    m.def("log_dropped", &log_dropped, "Core log records dropped on a full queue.");
}

}  // namespace kvmove::bindings
