#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "common/hash.h"
#include "memory/block_hash.h"

namespace py = pybind11;

namespace kvmove::bindings {

namespace {

// A hash of common/hash.h over Python bytes.
template <uint64_t (*Hash)(const void*, size_t, uint64_t)>
uint64_t of_bytes(const py::bytes& data, uint64_t seed) {
    std::string_view view(data);
    return Hash(view.data(), view.size(), seed);
}

}  // namespace

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
    m.def("xxh64", &of_bytes<xxh64>, py::arg("data"), py::arg("seed") = 0);
    m.def("xxh3", &of_bytes<xxh3>, py::arg("data"), py::arg("seed") = 0);
}

}  // namespace kvmove::bindings
