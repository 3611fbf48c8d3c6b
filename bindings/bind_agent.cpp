#include <pybind11/stl.h>

#include "bindings.h"
#include "ids.h"
#include "transport/agent.h"
#include "transport/metadata.h"

namespace py = pybind11;

namespace kvmove::bindings {

namespace {

// bytes <-> std::vector<uint8_t> for metadata, which is binary, not a list of ints.
std::vector<uint8_t> to_vector(const std::string& b) {
    return {b.begin(), b.end()};
}

py::bytes to_bytes(const std::vector<uint8_t>& v) {
    return {reinterpret_cast<const char*>(v.data()), v.size()};
}

py::tuple to_notification(const Notification& n) {
    return py::make_tuple(n.peer, py::bytes(n.payload));
}

using StartFn = std::shared_ptr<Transfer> (Agent::*)(
    const std::string&, const std::vector<BlockId>&, const std::vector<BlockId>&,
    const std::optional<std::vector<int64_t>>&, const std::optional<std::string>&, TrafficClass);

// write/read with block-id lists read by the fast Ids caster.
auto transfer_method(StartFn start) {
    return [start](Agent& a, const std::string& peer, const Ids& local, const Ids& remote,
                   const std::optional<std::vector<int64_t>>& layers,
                   const std::optional<std::string>& notify, TrafficClass traffic) {
        return (a.*start)(peer, local.values, remote.values, layers, notify, traffic);
    };
}

}  // namespace

void register_agent(py::module_& m) {
    py::enum_<TrafficClass>(m, "TrafficClass")
        .value("handoff", TrafficClass::Handoff)
        .value("prefetch", TrafficClass::Prefetch)
        .value("offload", TrafficClass::Offload);
    // The metadata codec, for tests and fuzzing (an Agent decodes only what verified).
    m.def(
        "decode_metadata",
        [](const py::bytes& data) {
            const AgentMetadata meta = decode(to_vector(std::string(data)));
            py::dict out;
            out["name"] = meta.name;
            out["incarnation"] = meta.incarnation;
            out["started_ns"] = meta.started_ns;
            out["worker_address"] = to_bytes(meta.worker_address);
            out["host"] = py::make_tuple(meta.host.boot_id, meta.host.netns_ino,
                                         meta.host.pidns_ino, meta.host.pid);
            py::list segments;
            for (const RemoteSegment& s : meta.segments) {
                segments.append(py::make_tuple(s.addr, s.nbytes, to_bytes(s.packed_rkey), s.memfd,
                                               s.memfd_dev, s.memfd_ino));
            }
            out["segments"] = segments;
            out["num_layers"] = meta.num_layers;
            out["num_blocks"] = meta.num_blocks;
            out["num_parts"] = meta.num_parts;
            py::list planes;
            for (const Plane& p : meta.planes) {
                planes.append(py::make_tuple(p.base, p.block_stride, p.block_nbytes, p.segment));
            }
            out["planes"] = planes;
            out["block_nbytes"] = meta.shape.nbytes();
            out["order"] = std::string(order_name(meta.shape.order));
            out["head_first"] = meta.shape.head_first;
            out["total_kv_heads"] = meta.shape.total_kv_heads;
            return out;
        },
        py::arg("data"));
    using release = py::call_guard<py::gil_scoped_release>;
    py::enum_<TransferState>(m, "TransferState")
        .value("PENDING", TransferState::Pending)
        .value("DONE", TransferState::Done)
        .value("FAILED", TransferState::Failed);

    py::class_<TransferStats>(m, "TransferStats")
        .def_readonly("nbytes", &TransferStats::nbytes)
        .def_readonly("num_ops", &TransferStats::num_ops)
        .def_readonly("post_seconds", &TransferStats::post_seconds)
        .def_readonly("complete_seconds", &TransferStats::complete_seconds)
        .def("__repr__", [](const TransferStats& s) {
            return py::str(
                       "TransferStats(nbytes={}, num_ops={}, post_seconds={:.6f}, "
                       "complete_seconds={:.6f})")
                .format(s.nbytes, s.num_ops, s.post_seconds, s.complete_seconds);
        });

    py::class_<Transfer, std::shared_ptr<Transfer>>(m, "Transfer")
        .def_property_readonly("peer", &Transfer::peer)
        .def_property_readonly("state", &Transfer::state)
        .def_property_readonly("stats", &Transfer::stats)
        .def_property_readonly("error", &Transfer::error)
        .def("wait", &Transfer::wait, py::arg("timeout"), release());

    py::class_<StreamStats>(m, "StreamStats")
        .def_readonly("leases_granted", &StreamStats::leases_granted)
        .def_readonly("leases_active", &StreamStats::leases_active)
        .def_readonly("blocks_quarantined", &StreamStats::blocks_quarantined)
        .def_readonly("leases_quarantined", &StreamStats::leases_quarantined)
        .def_readonly("leases_expired", &StreamStats::leases_expired)
        .def_readonly("cancels_sent", &StreamStats::cancels_sent)
        .def_readonly("senders_disconnected", &StreamStats::senders_disconnected)
        .def_readonly("messages_refused", &StreamStats::messages_refused)
        .def_readonly("begins_refused", &StreamStats::begins_refused)
        .def_readonly("checksum_mismatches", &StreamStats::checksum_mismatches)
        .def_readonly("acks_missed", &StreamStats::acks_missed)
        .def_readonly("unknown_senders", &StreamStats::unknown_senders)
        .def_readonly("messages_dropped", &StreamStats::messages_dropped);

    py::class_<Agent>(m, "Agent")
        .def(py::init([](std::string name, KVCache& cache, const BlockShape& shape,
                         std::string transports, bool peer_errors, double peer_timeout,
                         double cancel_timeout, double ack_timeout, std::string faults,
                         std::string net_devices, int64_t max_peers, bool map_same_host,
                         int copy_threads) {
                 return std::make_unique<Agent>(
                     std::move(name), cache, shape,
                     AgentConfig{std::move(transports), peer_errors, peer_timeout,
                                 StreamConfig{cancel_timeout, ack_timeout}, std::move(faults),
                                 std::move(net_devices), max_peers, map_same_host, copy_threads});
             }),
             py::arg("name"), py::arg("cache"), py::arg("shape"), py::arg("transports"),
             py::arg("peer_errors"), py::arg("peer_timeout"), py::arg("cancel_timeout"),
             py::arg("ack_timeout"), py::arg("faults"), py::arg("net_devices"),
             py::arg("max_peers"), py::arg("map_same_host") = true, py::arg("copy_threads") = 0,
             py::keep_alive<1, 3>(), release())
        .def("fault_counts", &Agent::fault_counts)
        .def_property_readonly("incarnation", &Agent::incarnation)
        .def("stream_stats", &Agent::stream_stats, release())
        .def_property_readonly("name", &Agent::name)
        .def_property_readonly("closed", &Agent::closed)
        .def("metadata", [](const Agent& a) { return to_bytes(a.metadata()); })
        .def(
            "add_peer",
            [](Agent& a, const std::string& meta, bool rejoin) {
                return a.add_peer(to_vector(meta), rejoin);
            },
            py::arg("metadata"), py::arg("rejoin") = false, release())
        .def("remove_peer", &Agent::remove_peer, py::arg("name"), release())
        .def_property_readonly("peers", &Agent::peers)
        .def("peer_transports", &Agent::peer_transports, py::arg("name"), release())
        .def("peer_path", &Agent::peer_path, py::arg("name"), release())
        .def("peer_shape", &Agent::peer_shape, py::arg("name"), release())
        .def("peer_alive", &Agent::peer_is_alive, py::arg("name"), release())
        .def("write", transfer_method(&Agent::write), py::arg("peer"), py::arg("local_ids"),
             py::arg("remote_ids"), py::arg("layers") = py::none(), py::arg("notify") = py::none(),
             py::arg("traffic") = TrafficClass::Handoff, release())
        .def("read", transfer_method(&Agent::read), py::arg("peer"), py::arg("local_ids"),
             py::arg("remote_ids"), py::arg("layers") = py::none(), py::arg("notify") = py::none(),
             py::arg("traffic") = TrafficClass::Handoff, release())
        .def(
            "stream_to",
            [](Agent& a, const std::string& peer, const Ids& local, const Ids& remote,
               const std::string& request_id, uint64_t epoch, bool checksums) {
                return a.stream_to(peer, local.values, remote.values, request_id, epoch, checksums);
            },
            py::arg("peer"), py::arg("local_ids"), py::arg("remote_ids"), py::arg("request_id"),
            py::arg("epoch"), py::arg("checksums"), py::keep_alive<0, 1>(), release())
        .def(
            "expect",
            [](Agent& a, const std::string& peer, const std::string& request_id, const Ids& local,
               double lease_seconds) {
                return a.expect(peer, request_id, local.values, lease_seconds);
            },
            py::arg("peer"), py::arg("request_id"), py::arg("local_ids"), py::arg("lease_seconds"),
            py::keep_alive<0, 1>(), release())
        .def(
            "offer",
            [](Agent& a, const std::string& peer, const std::string& request_id, const Ids& local,
               double lease_seconds) {
                return a.offer(peer, request_id, local.values, lease_seconds);
            },
            py::arg("peer"), py::arg("request_id"), py::arg("local_ids"), py::arg("lease_seconds"),
            py::keep_alive<0, 1>(), release())
        .def("offer_nothing", &Agent::offer_nothing, py::arg("peer"), py::arg("request_id"),
             release())
        .def("offers", &Agent::offers, release())
        .def("wait_offer", &Agent::wait_offer, py::arg("timeout"), release())
        .def("decline", &Agent::decline, py::arg("offer"), py::arg("reason"), release())
        .def(
            "notify",
            [](Agent& a, const std::string& peer, const py::bytes& payload) {
                std::string data = payload;
                py::gil_scoped_release nogil;
                return a.notify(peer, data);
            },
            py::arg("peer"), py::arg("payload"))
        .def(
            "_send_raw_stream_message",
            [](Agent& a, const std::string& peer, const py::bytes& message) {
                std::string data = message;
                py::gil_scoped_release nogil;
                a.send_raw_stream_message(peer, std::move(data));
            },
            py::arg("peer"), py::arg("message"))
        .def("notifications",
             [](Agent& a) {
                 py::list out;
                 for (const auto& n : a.notifications()) {
                     out.append(to_notification(n));
                 }
                 return out;
             })
        .def(
            "wait_notification",
            [](Agent& a, double timeout) {
                Notification n;
                {
                    py::gil_scoped_release nogil;
                    n = a.wait_notification(timeout);
                }
                return to_notification(n);
            },
            py::arg("timeout"))
        .def("close", &Agent::close, release());
}

}  // namespace kvmove::bindings
