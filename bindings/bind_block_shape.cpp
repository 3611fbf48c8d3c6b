#include "bindings.h"
#include "common/block_shape.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_block_shape(py::module_& m) {
    py::enum_<DType>(m, "DType")
        .value("float32", DType::Float32)
        .value("float16", DType::Float16)
        .value("bfloat16", DType::BFloat16)
        .value("float8", DType::Float8);
    py::class_<BlockShape>(m, "BlockShape",
                           "What one block of one layer holds (common/block_shape.h).")
        .def(py::init([](int32_t block_size, int32_t num_kv_heads, int32_t head_dim, DType dtype,
                         bool head_major) {
                 return BlockShape{block_size, num_kv_heads, head_dim, dtype, head_major};
             }),
             py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"),
             py::arg("head_major") = false)
        .def_readonly("block_size", &BlockShape::block_size)
        .def_readonly("num_kv_heads", &BlockShape::num_kv_heads)
        .def_readonly("head_dim", &BlockShape::head_dim)
        .def_readonly("dtype", &BlockShape::dtype)
        .def_readonly("head_major", &BlockShape::head_major)
        .def_property_readonly("nbytes", &BlockShape::nbytes, "Bytes of one block of one layer.");
}

}  // namespace kvmove::bindings
