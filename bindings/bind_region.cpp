#include "bindings.h"
#include "region.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_region(py::module_& m) {
    py::class_<Region>(m, "Region", py::buffer_protocol(), R"doc(
Host or device memory with one owner. A host region exposes its bytes zero-copy through the
buffer protocol (``numpy.frombuffer(region, numpy.uint8)`` is a writable view, not a copy); a
device region through ``__cuda_array_interface__`` (``torch.as_tensor(region, device="cuda")``).
)doc")
        .def(py::init<uint64_t, bool, int, bool>(), py::arg("nbytes"),
             py::arg("huge_pages") = false, py::arg("device") = -1, py::arg("pin") = false)
        .def_property_readonly("device", &Region::device, "CUDA device, or -1 for host memory.")
        .def_property_readonly("pinned", &Region::pinned,
                               "Host memory page-locked for DMA (cudaHostRegister).")
        .def_property_readonly("__cuda_array_interface__",
                               [](const Region& r) -> py::object {
                                   if (!r.on_device()) {
                                       throw py::attribute_error(
                                           "host memory has no __cuda_array_interface__");
                                   }
                                   py::dict cai;
                                   cai["shape"] = py::make_tuple(r.nbytes());
                                   cai["typestr"] = "|u1";
                                   cai["data"] = py::make_tuple(r.addr(), false);
                                   cai["version"] = 3;
                                   cai["strides"] = py::none();
                                   cai["stream"] = py::none();  // no stream: already synced
                                   return cai;
                               })
        .def_property_readonly("addr", &Region::addr)
        .def_property_readonly("nbytes", &Region::nbytes)
        .def_property_readonly("huge_pages", &Region::huge_pages)
        .def_buffer([](Region& r) {
            if (r.on_device()) {
                throw py::buffer_error("device memory has no buffer protocol: use "
                                       "__cuda_array_interface__");
            }
            return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(r.nbytes())}, {1});
        });
}

}  // namespace kvmove::bindings
