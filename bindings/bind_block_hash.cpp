#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "memory/block_hash.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_block_hash(py::module_& m) {
    m.def(
        "block_hashes",
        [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> tokens,
           int64_t block_size, std::optional<uint64_t> parent, uint64_t seed) {
            auto view = tokens.unchecked<1>();  // raises ValueError unless 1-D
            return block_hashes(view.data(0), view.shape(0), block_size, parent, seed);
        },
        py::arg("token_ids"), py::arg("block_size"), py::arg("parent") = py::none(),
        py::arg("seed") = 0);
    m.def(
        "xxh64",
        [](py::bytes data, uint64_t seed) {
            std::string_view view(data);
            return xxh64(view.data(), view.size(), seed);
        },
        py::arg("data"), py::arg("seed") = 0);
    m.def(
        "xxh3",
        [](py::bytes data, uint64_t seed) {
            std::string_view view(data);
            return xxh3(view.data(), view.size(), seed);
        },
        py::arg("data"), py::arg("seed") = 0);
}

}  // namespace kvmove::bindings
