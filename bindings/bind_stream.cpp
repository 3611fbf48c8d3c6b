#include <pybind11/stl.h>

#include "bindings.h"
#include "stream/layer_stream.h"
#include "stream/offer_box.h"
#include "stream/stream_message.h"

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

MessageKind kind_named(const std::string& name) {
    for (uint8_t k = kFirstMessageKind; k <= kLastMessageKind; ++k) {
        if (name == message_kind_name(static_cast<MessageKind>(k))) {
            return static_cast<MessageKind>(k);
        }
    }
    KVMOVE_FAIL(Config, "unknown stream message kind '" << name << "'");
}

}  // namespace

void register_stream(py::module_& m) {
    using release = py::call_guard<py::gil_scoped_release>;
    // The stream messages' codec, for tests and fuzzing: peers' messages are untrusted input.
    m.def(
        "encode_stream_message",
        [](const std::string& kind, const std::string& request_id, uint64_t epoch, uint32_t layer,
           uint64_t ids_hash, std::vector<uint64_t> checksums, const py::bytes& payload,
           std::vector<BlockId> block_ids) {
            StreamMessage message =
                lease_message(kind_named(kind), request_id, epoch, ids_hash, payload);
            message.layer = layer;
            message.checksums = std::move(checksums);
            message.block_ids = std::move(block_ids);
            return py::bytes(encode(message));
        },
        py::arg("kind"), py::arg("request_id"), py::arg("epoch"), py::arg("layer") = 0,
        py::arg("ids_hash") = 0, py::arg("checksums") = std::vector<uint64_t>{},
        py::arg("payload") = py::bytes(), py::arg("block_ids") = std::vector<BlockId>{});
    m.def(
        "decode_stream_message",
        [](const py::bytes& data) {
            const std::string bytes(data);
            const StreamMessage message = decode_stream_message(bytes.data(), bytes.size());
            py::dict out;
            out["kind"] = message_kind_name(message.kind);
            out["request_id"] = message.request_id;
            out["epoch"] = message.epoch;
            out["layer"] = message.layer;
            out["ids_hash"] = message.ids_hash;
            out["checksums"] = message.checksums;
            out["payload"] = py::bytes(message.payload);
            out["block_ids"] = message.block_ids;
            return out;
        },
        py::arg("data"));
    m.def("hash_ids", &hash_ids, py::arg("ids"));
    py::class_<Offer>(m, "Offer")
        .def(py::init<std::string, std::string, uint64_t, std::vector<BlockId>>(), py::arg("peer"),
             py::arg("request_id"), py::arg("epoch"), py::arg("block_ids"))
        .def_readonly("peer", &Offer::peer)
        .def_readonly("request_id", &Offer::request_id)
        .def_readonly("epoch", &Offer::epoch)
        .def_readonly("block_ids", &Offer::block_ids);
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
