#include "bindings.h"
#include "memory/region.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_region(py::module_& m) {
    py::class_<Region>(m, "Region", py::buffer_protocol())
        .def(py::init<uint64_t, bool, int, bool>(), py::arg("nbytes"),
             py::arg("huge_pages") = false, py::arg("device") = -1, py::arg("pin") = false)
        .def_property_readonly("addr", &Region::addr)
        .def_property_readonly("nbytes", &Region::nbytes)
        .def_property_readonly("huge_pages", &Region::huge_pages)
        .def_property_readonly("device", &Region::device)
        .def_property_readonly("pinned", &Region::pinned)
        .def_buffer([](Region& r) {
            return py::buffer_info(r.host_data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(r.nbytes())}, {1});
        });
}

}  // namespace kvmove::bindings
