#include <pybind11/stl.h>

#include "bindings.h"
#include "ids.h"
#include "memory/block_pool.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_block_pool(py::module_& m) {
    using release = py::call_guard<py::gil_scoped_release>;
    py::class_<BlockPool>(m, "BlockPool")
        .def(py::init<int64_t>(), py::arg("num_blocks"))
        .def_property_readonly("num_blocks", &BlockPool::num_blocks)
        .def_property_readonly("num_free", &BlockPool::num_free)
        .def_property_readonly("num_used", &BlockPool::num_used)
        .def_property_readonly("num_cached", &BlockPool::num_cached)
        .def(
            "allocate", [](BlockPool& p, int64_t n) { return to_ids(p.allocate(n)); }, py::arg("n"),
            release())
        .def(
            "free", [](BlockPool& p, const Ids& ids) { p.free(ids.values); }, py::arg("ids"),
            release())
        .def(
            "share", [](BlockPool& p, const Ids& ids) { p.share(ids.values); }, py::arg("ids"),
            release())
        .def(
            "commit",
            [](BlockPool& p, const Ids& ids, const std::vector<BlockHash>& hashes) {
                p.commit(ids.values, hashes);
            },
            py::arg("ids"), py::arg("hashes"), release())
        .def(
            "match",
            [](BlockPool& p, const std::vector<BlockHash>& hashes) { return Ids{p.match(hashes)}; },
            py::arg("hashes"), release())
        .def("ref_count", &BlockPool::ref_count, py::arg("id"))
        .def("block_hash", &BlockPool::block_hash, py::arg("id"));
}

}  // namespace kvmove::bindings
