// Fast conversion of block-id lists, the hottest values crossing the boundary.
//
// pybind11's generic list caster converts element by element through its int caster (about
// 12 ns per id); reading the list directly is about 3 ns, which is the difference between a
// 256-block allocate+free costing ~12 us and ~6 us. Ids is a plain vector with its own caster.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace kvmove::bindings {

struct Ids {
    std::vector<int64_t> values;
};

inline std::optional<Ids> to_ids(std::optional<std::vector<int64_t>>&& ids) {
    return ids ? std::optional<Ids>(Ids{std::move(*ids)}) : std::nullopt;
}

}  // namespace kvmove::bindings

namespace pybind11::detail {

template <>
struct type_caster<kvmove::bindings::Ids> {
    PYBIND11_TYPE_CASTER(kvmove::bindings::Ids, const_name("list[int]"));

    // Accepts any sequence of ints (list, tuple, range, numpy array...).
    bool load(handle src, bool) {
        if (!src || PyUnicode_Check(src.ptr()) || PyBytes_Check(src.ptr())) {
            return false;
        }
        object seq = reinterpret_steal<object>(PySequence_Fast(src.ptr(), ""));
        if (!seq) {
            PyErr_Clear();
            return false;
        }
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
        PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
        value.values.resize(static_cast<size_t>(n));
        for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject* item = items[i];
            object index;  // owns the int of a non-int item that has __index__ (numpy ints)
            if (!PyLong_Check(item)) {
                // __index__ runs Python code, which may mutate a list under our item pointers:
                // read the rest from a tuple copy, which nothing can change.
                if (PyList_Check(seq.ptr())) {
                    seq = reinterpret_steal<object>(PyList_AsTuple(seq.ptr()));
                    if (!seq) {
                        PyErr_Clear();
                        return false;
                    }
                    items = PySequence_Fast_ITEMS(seq.ptr());
                    item = items[i];
                }
                index =
                    reinterpret_steal<object>(PyIndex_Check(item) ? PyNumber_Index(item) : nullptr);
                if (!index) {
                    PyErr_Clear();
                    return false;
                }
                item = index.ptr();
            }
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                return false;
            }
            value.values[static_cast<size_t>(i)] = v;
        }
        return true;
    }

    static handle cast(const kvmove::bindings::Ids& ids, return_value_policy, handle) {
        PyObject* list = PyList_New(static_cast<Py_ssize_t>(ids.values.size()));
        if (list == nullptr) {
            throw error_already_set();
        }
        for (size_t i = 0; i < ids.values.size(); ++i) {
            PyObject* item = PyLong_FromLongLong(ids.values[i]);
            if (item == nullptr) {
                Py_DECREF(list);
                throw error_already_set();
            }
            PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
        }
        return list;
    }
};

}  // namespace pybind11::detail
