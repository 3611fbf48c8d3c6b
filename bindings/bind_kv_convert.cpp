#include <pybind11/stl.h>

#include "bindings.h"
#include "convert/kv_convert.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_kv_convert(py::module_& m) {
    m.def("pack_blocks", &pack_blocks, py::arg("cache"), py::arg("block_ids"), py::arg("layers"),
          py::arg("staging_addr"), py::arg("staging_nbytes"),
          py::call_guard<py::gil_scoped_release>());
    m.def("unpack_blocks", &unpack_blocks, py::arg("staging_addr"), py::arg("staging_nbytes"),
          py::arg("cache"), py::arg("block_ids"), py::arg("layers"),
          py::call_guard<py::gil_scoped_release>());
    m.def("convert_blocks", &convert_blocks, py::arg("src"), py::arg("src_shape"),
          py::arg("src_ids"), py::arg("dst"), py::arg("dst_shape"), py::arg("dst_ids"),
          py::arg("num_tokens"), py::arg("layers"), py::arg("scales_addr"),
          py::arg("scales_nbytes"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace kvmove::bindings
