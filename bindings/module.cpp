// kvmove._C: registers each area's bindings and the one exception translator.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "common/errors.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "kvmove's compiled core. Private: import kvmove instead.";
    kvmove::bindings::register_block_pool(m);
    kvmove::bindings::register_block_hash(m);
    kvmove::bindings::register_block_shape(m);
    kvmove::bindings::register_region(m);
    kvmove::bindings::register_kv_cache(m);
    kvmove::bindings::register_block_file(m);
    kvmove::bindings::register_kv_convert(m);
    kvmove::bindings::register_runtime(m);
    kvmove::bindings::register_stream(m);
    kvmove::bindings::register_agent(m);
    // kvmove::Error -> the kvmove.errors class its kind names (kvmove/__init__.py imports
    // kvmove.errors before this module, so the import below is a dictionary lookup).
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            std::rethrow_exception(p);
        } catch (const kvmove::Error& e) {
            py::object cls =
                py::module_::import("kvmove.errors").attr(kvmove::error_class_name(e.kind()));
            PyErr_SetString(cls.ptr(), e.what());
        }
    });
}
