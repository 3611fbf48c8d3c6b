#include <pybind11/stl.h>

#include "bindings.h"
#include "ids.h"
#include "memory/block_pool.h"

namespace py = pybind11;

namespace kvmove::bindings {

void register_block_pool(py::module_& m) {
    using release = py::call_guard<py::gil_scoped_release>;
    py::class_<BlockPool>(m, "BlockPool", R"doc(
Fixed pool of ``num_blocks`` equal blocks with ids ``0..num_blocks-1``: reference counts,
contiguity-aware allocation and a prefix cache keyed by block hashes. Owns no memory (see
``KVCache``). Thread-safe: every call holds the pool's lock and releases the GIL.

A block is *free* (ref 0), *cached* (ref 0, carries a hash: evictable, revived by ``match``)
or *used* (ref > 0). ``num_free`` counts free and cached blocks.
)doc")
        .def(py::init<int64_t>(), py::arg("num_blocks"))
        .def_property_readonly("num_blocks", &BlockPool::num_blocks)
        .def_property_readonly("num_free", &BlockPool::num_free,
                               "Free plus cached (evictable) blocks.")
        .def_property_readonly("num_used", &BlockPool::num_used)
        .def_property_readonly("num_cached", &BlockPool::num_cached,
                               "Freed blocks that carry a hash, kept until evicted.")
        .def(
            "allocate", [](BlockPool& p, int64_t n) { return to_ids(p.allocate(n)); }, py::arg("n"),
            release(), R"doc(
``n`` blocks with reference count 1, in as few runs of consecutive ids as possible; ``None``
when fewer than ``n`` are free right now (back-pressure). All-or-nothing. Evicts least
recently used cached blocks when free ones are not enough.

Raises:
    ConfigError: ``n < 1`` or ``n > num_blocks``.
)doc")
        .def(
            "free", [](BlockPool& p, const Ids& ids) { p.free(ids.values); }, py::arg("ids"),
            release(), R"doc(
Drops one reference per occurrence of each id. At zero a block with a hash becomes cached
(LRU, the list's last block evicted first), one without returns to the free runs.

Raises:
    BlockError: an id out of range, a free block, or more frees than references.
)doc")
        .def(
            "share", [](BlockPool& p, const Ids& ids) { p.share(ids.values); }, py::arg("ids"),
            release(),
            "Adds one reference per occurrence of each id. Raises BlockError for a block "
            "that is not allocated.")
        .def(
            "commit",
            [](BlockPool& p, const Ids& ids, const std::vector<BlockHash>& hashes) {
                p.commit(ids.values, hashes);
            },
            py::arg("ids"), py::arg("hashes"), release(), R"doc(
Tags used blocks with content hashes (``block_hashes``) so that, once freed, they stay cached
and ``match`` can find them. A hash already held by another block is left to that block.

Raises:
    ConfigError: ``len(ids) != len(hashes)``.
    BlockError: an id out of range, not allocated, or already tagged with another hash.
)doc")
        .def(
            "match",
            [](BlockPool& p, const std::vector<BlockHash>& hashes) { return Ids{p.match(hashes)}; },
            py::arg("hashes"), release(),
            "Ids of the longest cached prefix of ``hashes``, each with one new reference "
            "(the caller frees them like allocated blocks).")
        .def("ref_count", &BlockPool::ref_count, py::arg("id"))
        .def("block_hash", &BlockPool::block_hash, py::arg("id"),
             "The hash committed to block ``id``, or None.");
}

}  // namespace kvmove::bindings
