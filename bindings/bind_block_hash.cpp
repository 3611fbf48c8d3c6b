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
        py::arg("seed") = 0, R"doc(
Chained 64-bit content hashes of the full blocks of ``token_ids`` (a trailing partial block
gets none): block i's hash is XXH64 of its parent's hash and its tokens (as little-endian
int64), so equal hashes mean equal prefixes. ``parent`` continues a chain from an earlier
block's hash. Pass the result to ``BlockPool.commit`` / ``BlockPool.match``.

Args:
    token_ids: ``[num_tokens]`` integer ids (list or array; converted to int64).
    block_size: tokens per block.
    parent: hash of the block before ``token_ids[0]``, or None at the start of a sequence.
    seed: XXH64's seed (0: the plain chain; a secret one for keyed hashes).
)doc");
    m.def(
        "xxh64",
        [](py::bytes data, uint64_t seed) {
            std::string_view view(data);
            return xxh64(view.data(), view.size(), seed);
        },
        py::arg("data"), py::arg("seed") = 0, "XXH64 of ``data`` (the hash block_hashes uses).");
}

}  // namespace kvmove::bindings
