#include "transport/ucx_path.h"

namespace kvmove {

namespace {

// What a UCX callback completes: the batch's or message's `done`, and a message's bytes, which
// must live until UCX is done with them.
struct Pending {
    PathDone done;
    std::string message;
};

// Runs `pending->done` now when `request` completed (or failed) at once; else UCX calls
// UcxPath::on_complete with it later.
void settle(ucs_status_ptr_t request, std::unique_ptr<Pending> pending) {
    if (request == nullptr || UCS_PTR_IS_ERR(request)) {
        pending->done(outcome_of(UCS_PTR_STATUS(request)));
        return;
    }
    pending.release();  // owned by the request's callback now
}

}  // namespace

PortOutcome outcome_of(ucs_status_t status) {
    if (status == UCS_OK) {
        return {};
    }
    // NOT_CONNECTED: a killed peer's socket seen closed by an operation in flight (a read
    // under ASan in CI), before UCX's error handler ran.
    bool peer_gone = status == UCS_ERR_ENDPOINT_TIMEOUT || status == UCS_ERR_CONNECTION_RESET ||
                     status == UCS_ERR_UNREACHABLE || status == UCS_ERR_CANCELED ||
                     status == UCS_ERR_NOT_CONNECTED;
    return {false, peer_gone ? ErrorKind::Peer : ErrorKind::Transfer,
            std::string("UCX reported ") + ucs_status_string(status)};
}

UcxPath::UcxPath(ucp_worker_h worker, const AgentMetadata& peer, bool peer_errors,
                 ucp_err_handler_cb_t on_error, void* error_arg) {
    try {
        endpoint_ = std::make_unique<Endpoint>(worker, peer.worker_address, peer_errors, on_error,
                                               error_arg);
    } catch (const Error& e) {
        KVMOVE_FAIL(Peer, "cannot reach peer '" << peer.name << "': " << e.what());
    }
    try {
        for (const RemoteSegment& segment : peer.segments) {
            rkeys_.push_back(endpoint_->unpack_rkey(segment.packed_rkey));
        }
    } catch (const Error& e) {
        KVMOVE_FAIL(Metadata, "bad agent metadata from '" << peer.name << "': " << e.what());
    }
}

void UcxPath::on_complete(void* request, ucs_status_t status, void* user_data) {
    ucp_request_free(request);
    std::unique_ptr<Pending> pending(static_cast<Pending*>(user_data));
    pending->done(outcome_of(status));
}

// One put or get per range (here: local, there: remote), then a flush that completes when
// they all did.
void UcxPath::post(PathBatch batch, PathDone done) {
    ucp_request_param_t none{};  // no callback: the flush that follows reports completion
    for (const RangePair& op : batch.ranges) {
        void* local = reinterpret_cast<void*>(op.here);
        ucp_rkey_h rkey = rkeys_[op.there_segment].get();  // decode() bounded the index
        ucs_status_ptr_t request =
            batch.direction == Direction::Put
                ? ucp_put_nbx(endpoint_->get(), local, op.nbytes, op.there, rkey, &none)
                : ucp_get_nbx(endpoint_->get(), local, op.nbytes, op.there, rkey, &none);
        if (UCS_PTR_IS_ERR(request)) {
            done({false, ErrorKind::Transfer,
                  "posting " + std::to_string(op.nbytes) +
                      " bytes: " + ucs_status_string(UCS_PTR_STATUS(request))});
            return;
        }
        if (request != nullptr) {
            ucp_request_free(request);  // completes in the background; the flush waits for it
        }
    }
    auto pending = std::make_unique<Pending>(Pending{std::move(done), {}});
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxPath::on_complete;
    param.user_data = pending.get();
    settle(ucp_ep_flush_nbx(endpoint_->get(), &param), std::move(pending));
}

void UcxPath::send(unsigned am_id, std::string message, bool rendezvous, PathDone done) {
    auto pending = std::make_unique<Pending>(Pending{std::move(done), std::move(message)});
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &UcxPath::on_complete;
    param.user_data = pending.get();
    // Eager: the receiver's handler sees the whole payload at once. Reply: the receiver knows
    // the message by our endpoint (the only thing it trusts), not by any name in it.
    param.flags =
        (rendezvous ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER) | UCP_AM_SEND_FLAG_REPLY;
    // Fast completion: over tcp a message of up to 8,176 bytes then goes as UCX's "short"
    // protocol, copied into the socket at once, so send() completes before it returns.
    // Without it UCX sent every message over 0 bytes zero-copy (UCX_PROTO_INFO=y), whose
    // completion came only with the worker's next event: a writer's wait() lasted until then.
    if (!rendezvous) {
        param.op_attr_mask |= UCP_OP_ATTR_FLAG_FAST_CMPL;
    }
    const std::string& bytes = pending->message;
    settle(ucp_am_send_nbx(endpoint_->get(), am_id, nullptr, 0, bytes.data(), bytes.size(), &param),
           std::move(pending));
}

void UcxPath::close(bool force, double timeout_seconds) {
    rkeys_.clear();  // no use of a gone peer's remote key: the keys go before their endpoint
    endpoint_->close(force, timeout_seconds);
}

}  // namespace kvmove
