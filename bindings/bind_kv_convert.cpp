#include <pybind11/stl.h>

#include "bindings.h"
#include "convert/kv_convert.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_kv_convert(py::module_& m) {
    py::enum_<DType>(m, "DType")
        .value("float32", DType::Float32)
        .value("float16", DType::Float16)
        .value("bfloat16", DType::BFloat16)
        .value("float8", DType::Float8);
    py::class_<BlockShape>(m, "BlockShape", "A block's geometry for convert_blocks.")
        .def(py::init([](int32_t block_size, int32_t num_heads, int32_t head_dim, DType dtype,
                         bool head_major) {
                 return BlockShape{block_size, num_heads, head_dim, dtype, head_major};
             }),
             py::arg("block_size"), py::arg("num_heads"), py::arg("head_dim"), py::arg("dtype"),
             py::arg("head_major") = false);
    m.def("pack_blocks", &pack_blocks, py::arg("cache"), py::arg("block_ids"), py::arg("layers"),
          py::arg("staging_addr"), py::arg("staging_nbytes"),
          py::call_guard<py::gil_scoped_release>(),
          "Copies blocks of layers into a contiguous [layers, blocks, block_nbytes] buffer.");
    m.def("unpack_blocks", &unpack_blocks, py::arg("staging_addr"), py::arg("staging_nbytes"),
          py::arg("cache"), py::arg("block_ids"), py::arg("layers"),
          py::call_guard<py::gil_scoped_release>(), "The reverse of pack_blocks.");
    m.def("convert_blocks", &convert_blocks, py::arg("src"), py::arg("src_shape"),
          py::arg("src_ids"), py::arg("dst"), py::arg("dst_shape"), py::arg("dst_ids"),
          py::arg("num_tokens"), py::arg("layers"), py::arg("scales_addr"),
          py::arg("scales_nbytes"), py::call_guard<py::gil_scoped_release>(),
          "Copies num_tokens tokens between caches of other block sizes, head orders, dtypes.");
}

}  // namespace kvmove::bindings
