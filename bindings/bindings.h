// One register_<thing>() per bound concept; module.cpp calls them all.
#pragma once

#include <pybind11/pybind11.h>

namespace kvmove::bindings {

void register_block_pool(pybind11::module_& m);
void register_block_hash(pybind11::module_& m);
void register_block_shape(pybind11::module_& m);
void register_region(pybind11::module_& m);
void register_kv_cache(pybind11::module_& m);
void register_block_file(pybind11::module_& m);
void register_kv_convert(pybind11::module_& m);
void register_runtime(pybind11::module_& m);
void register_stream(pybind11::module_& m);
void register_agent(pybind11::module_& m);

}  // namespace kvmove::bindings
