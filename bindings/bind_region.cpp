#include "bindings.h"
#include "region.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_region(py::module_& m) {
    py::class_<Region>(m, "Region", py::buffer_protocol(), R"doc(
Page-aligned host memory with one owner. Exposes its bytes zero-copy through the buffer
protocol: ``numpy.frombuffer(region, numpy.uint8)`` is a writable view, not a copy.
)doc")
        .def(py::init<uint64_t, bool>(), py::arg("nbytes"), py::arg("huge_pages") = false)
        .def_property_readonly("addr", &Region::addr)
        .def_property_readonly("nbytes", &Region::nbytes)
        .def_property_readonly("huge_pages", &Region::huge_pages)
        .def_buffer([](Region& r) {
            return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(r.nbytes())}, {1});
        });
}

}  // namespace kvmove::bindings
