#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "common/errors.h"
#include "common/log.h"
#include "cuda/cuda_status.h"
#include "transport/copier.h"
#include "transport/ucx.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_runtime(py::module_& m) {
    m.def("ucx_version", &ucx_version);
    m.def("default_copy_threads", &default_copy_threads);
    m.def("copy_limit_gbytes_per_s", &copy_limit_gbytes_per_s, py::arg("nbytes"),
          py::arg("threads") = 0, py::arg("repeats") = 3, py::call_guard<py::gil_scoped_release>());
    m.def("peer_error_settings", &peer_error_settings);
    m.def("tcp_settings", &tcp_settings);
    m.def("ucx_library", &ucx_library);
    m.def("ucx_built_version", &ucx_built_version);
    m.def("ucx_resources", [] {
        using Row = std::tuple<std::string, std::string, std::string, std::string, std::string>;
        std::vector<Row> out;
        for (const UcxResource& r : ucx_resources()) {
            out.emplace_back(r.component, r.memory_domain, r.transport, r.device, r.device_type);
        }
        return out;
    });
    m.def("cuda_status", [] {
        CudaStatus s = cuda_status();
        return py::make_tuple(s.built, s.device_count, s.reason);
    });
    m.def("check_timeout", &check_timeout, py::arg("timeout"));
    m.def("set_log_level", &set_log_level, py::arg("level"));
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
        py::arg("max_records") = 1000);
    m.def("log_dropped", &log_dropped);
}

}  // namespace kvmove::bindings
