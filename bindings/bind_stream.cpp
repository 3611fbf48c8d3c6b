#include <pybind11/stl.h>

#include "bindings.h"
#include "stream/layer_stream.h"

namespace py = pybind11;

namespace kvmove::bindings {

namespace {

template <typename Stream>
py::list layer_times(const Stream& s) {
    py::list out;
    for (const LayerTiming& t : s.layer_times()) {
        out.append(py::make_tuple(t.posted, t.landed));
    }
    return out;
}

}  // namespace

void register_stream(py::module_& m) {
    using release = py::call_guard<py::gil_scoped_release>;
    py::enum_<StreamState>(m, "StreamState")
        .value("OPEN", StreamState::Open)
        .value("DONE", StreamState::Done)
        .value("ABORTED", StreamState::Aborted)
        .value("FAILED", StreamState::Failed);

    py::class_<SaveStream, std::shared_ptr<SaveStream>>(m, "SaveStream")
        .def_property_readonly("peer", &SaveStream::peer)
        .def_property_readonly("request_id", &SaveStream::request_id)
        .def_property_readonly("num_layers", &SaveStream::num_layers)
        .def_property_readonly("num_blocks", &SaveStream::num_blocks)
        .def_property_readonly("epoch", &SaveStream::epoch)
        .def_property_readonly("checksums", &SaveStream::checksums)
        .def_property_readonly("answered", &SaveStream::answered)
        .def_property_readonly("state", &SaveStream::state)
        .def_property_readonly("error", &SaveStream::error)
        .def("layer_times", &layer_times<SaveStream>)
        .def("save_layer", &SaveStream::save_layer, py::arg("layer"), py::arg("cuda_event"),
             release())
        .def(
            "finish",
            [](SaveStream& s, const py::bytes& payload) {
                std::string data = payload;
                py::gil_scoped_release nogil;
                s.finish(data);
            },
            py::arg("payload"))
        .def("abort", &SaveStream::abort, release())
        .def("wait", &SaveStream::wait, py::arg("timeout"), release());

    py::class_<LoadStream, std::shared_ptr<LoadStream>>(m, "LoadStream")
        .def_property_readonly("peer", &LoadStream::peer)
        .def_property_readonly("request_id", &LoadStream::request_id)
        .def_property_readonly("num_layers", &LoadStream::num_layers)
        .def_property_readonly("local_ids", &LoadStream::local_ids)
        .def_property_readonly("epoch", &LoadStream::epoch)
        .def_property_readonly("released", &LoadStream::released)
        .def("wait_released", &LoadStream::wait_released, py::arg("timeout"), release())
        .def("bad_blocks", &LoadStream::bad_blocks)
        .def_property_readonly("state", &LoadStream::state)
        .def_property_readonly("error", &LoadStream::error)
        .def_property_readonly("payload",
                               [](const LoadStream& s) { return py::bytes(s.payload()); })
        .def("layers_ready", &LoadStream::layers_ready)
        .def("layer_times", &layer_times<LoadStream>)
        .def("start_load", &LoadStream::start_load, release())
        .def("cancel", &LoadStream::cancel, release())
        .def("wait_for_layer", &LoadStream::wait_for_layer, py::arg("layer"), py::arg("timeout"),
             release())
        .def(
            "wait_all",
            [](const LoadStream& s, double timeout) {
                std::string payload;
                {
                    py::gil_scoped_release nogil;
                    payload = s.wait_all(timeout);
                }
                return py::bytes(payload);
            },
            py::arg("timeout"));
}

}  // namespace kvmove::bindings
