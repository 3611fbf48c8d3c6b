#include <pybind11/stl.h>

#include "bindings.h"
#include "memory/block_checksum.h"
#include "memory/kv_cache.h"

namespace py = pybind11;

namespace pybind11::detail {

// kvmove::Descriptor <-> (addr, nbytes) tuple.
template <>
struct type_caster<kvmove::Descriptor> {
    PYBIND11_TYPE_CASTER(kvmove::Descriptor, const_name("tuple[int, int]"));

    bool load(handle src, bool convert) {
        make_caster<std::pair<uint64_t, uint64_t>> pair;
        if (!pair.load(src, convert)) {
            return false;
        }
        auto [addr, nbytes] = cast_op<std::pair<uint64_t, uint64_t>>(pair);
        value = {addr, nbytes};
        return true;
    }

    static handle cast(const kvmove::Descriptor& d, return_value_policy, handle) {
        return py::make_tuple(d.addr, d.nbytes).release();
    }
};

}  // namespace pybind11::detail

namespace kvmove::bindings {

void register_kv_cache(py::module_& m) {
    py::class_<KVCache>(m, "KVCache")
        .def(py::init<int64_t, int64_t, int64_t, bool, int, bool>(), py::arg("num_layers"),
             py::arg("num_blocks"), py::arg("block_nbytes"), py::arg("huge_pages") = false,
             py::arg("device") = -1, py::arg("pin") = false)
        .def(py::init(
                 [](int64_t num_layers, int64_t num_blocks, int64_t num_parts,
                    const std::vector<std::tuple<uint64_t, uint64_t, uint64_t, uint32_t>>& planes,
                    std::vector<Descriptor> segments, int device) {
                     std::vector<Plane> out;
                     for (const auto& [base, stride, nbytes, segment] : planes) {
                         out.push_back({base, stride, nbytes, segment});
                     }
                     return std::make_unique<KVCache>(
                         KVGeometry(num_layers, num_blocks, num_parts, std::move(out)),
                         std::move(segments), device);
                 }),
             py::arg("num_layers"), py::arg("num_blocks"), py::arg("num_parts"), py::arg("planes"),
             py::arg("segments"), py::arg("device"))
        .def_property_readonly("wrapped", &KVCache::wrapped)
        .def_property_readonly("device", &KVCache::device)
        .def_property_readonly("num_parts",
                               [](const KVCache& c) { return c.geometry().num_parts(); })
        .def_property_readonly("segments", &KVCache::segments)
        .def_property_readonly(
            "planes",
            [](const KVCache& c) {
                std::vector<std::tuple<uint64_t, uint64_t, uint64_t, uint32_t>> out;
                for (const Plane& p : c.geometry().planes()) {
                    out.emplace_back(p.base, p.block_stride, p.block_nbytes, p.segment);
                }
                return out;
            })
        .def_property_readonly("pool", &KVCache::pool, py::return_value_policy::reference_internal)
        .def_property_readonly(
            "region", [](KVCache& c) { return c.wrapped() ? nullptr : &c.region(); },
            py::return_value_policy::reference_internal)
        .def_property_readonly("num_layers", &KVCache::num_layers)
        .def_property_readonly("num_blocks", &KVCache::num_blocks)
        .def_property_readonly("block_nbytes", &KVCache::block_nbytes)
        .def("offset", &KVCache::offset, py::arg("layer"), py::arg("block"))
        .def("descriptors", &KVCache::descriptors, py::arg("block_ids"),
             py::arg("layers") = py::none(), py::call_guard<py::gil_scoped_release>());
    m.def("copy_blocks", &copy_blocks, py::arg("src"), py::arg("src_ids"), py::arg("dst"),
          py::arg("dst_ids"), py::call_guard<py::gil_scoped_release>());
    m.def("block_checksums", &block_checksums, py::arg("cache"), py::arg("ids"), py::arg("seeds"),
          py::call_guard<py::gil_scoped_release>());
    m.def("runs", &runs, py::arg("ids"));
}

}  // namespace kvmove::bindings
