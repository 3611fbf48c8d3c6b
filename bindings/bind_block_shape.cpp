#include <pybind11/stl.h>

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
    py::enum_<BlockOrder>(m, "BlockOrder")
        .value("NHD", BlockOrder::NHD)
        .value("HND", BlockOrder::HND)
        .value("VLLM_CPU", BlockOrder::VllmCpu)
        .value("MLA", BlockOrder::MLA);
    m.def(
        "parse_order",
        [](const std::string& name) -> std::optional<BlockOrder> {
            BlockOrder order;
            return parse_order(name, order) ? std::optional(order) : std::nullopt;
        },
        py::arg("name"));
    py::class_<BlockShape>(m, "BlockShape")
        .def(py::init([](int32_t block_size, int32_t num_kv_heads, int32_t head_dim, DType dtype,
                         BlockOrder order, int32_t head_first,
                         std::optional<int32_t> total_kv_heads) {
                 return BlockShape{block_size,
                                   num_kv_heads,
                                   head_dim,
                                   dtype,
                                   order,
                                   head_first,
                                   total_kv_heads.value_or(num_kv_heads)};
             }),
             py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"),
             py::arg("order") = BlockOrder::NHD, py::arg("head_first") = 0,
             py::arg("total_kv_heads") = py::none())
        .def_readonly("block_size", &BlockShape::block_size)
        .def_readonly("num_kv_heads", &BlockShape::num_kv_heads)
        .def_readonly("head_dim", &BlockShape::head_dim)
        .def_readonly("dtype", &BlockShape::dtype)
        .def_readonly("order", &BlockShape::order)
        .def_readonly("head_first", &BlockShape::head_first)
        .def_readonly("total_kv_heads", &BlockShape::total_kv_heads)
        .def_property_readonly("nbytes", &BlockShape::nbytes);
}

}  // namespace kvmove::bindings
