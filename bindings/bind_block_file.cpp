#include <pybind11/stl.h>

#include "bindings.h"
#include "storage/block_file.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_block_file(py::module_& m) {
    py::class_<BlockFile>(m, "BlockFile")
        .def(py::init<const std::string&, uint64_t, int64_t, bool>(), py::arg("path"),
             py::arg("block_nbytes"), py::arg("num_slots"), py::arg("direct") = true,
             py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("path", &BlockFile::path)
        .def_property_readonly("block_nbytes", &BlockFile::block_nbytes)
        .def_property_readonly("slot_nbytes", &BlockFile::slot_nbytes)
        .def_property_readonly("num_slots", &BlockFile::num_slots)
        .def_property_readonly("direct", &BlockFile::direct)
        .def("write", &BlockFile::write, py::arg("cache"), py::arg("block_ids"), py::arg("slots"),
             py::arg("hashes"), py::call_guard<py::gil_scoped_release>())
        .def("read", &BlockFile::read, py::arg("cache"), py::arg("block_ids"), py::arg("slots"),
             py::arg("hashes"), py::arg("checksums"), py::call_guard<py::gil_scoped_release>())
        .def("sync", &BlockFile::sync, py::call_guard<py::gil_scoped_release>())
        .def("close", &BlockFile::close, py::call_guard<py::gil_scoped_release>())
        .attr("SLOT_ALIGN") = BlockFile::kSlotAlign;
}

}  // namespace kvmove::bindings
