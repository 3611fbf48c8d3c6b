// UcxPath: a peer reached over UCX (transport/path.h). A batch is one put or get per range, on
// the peer's endpoint with its remote keys, then one flush: the flush's completion is the
// batch's `done`, and UCX completes flushes on one endpoint in posting order. Messages are
// UCX active messages, eager and with a reply endpoint (the receiver knows the sender by it,
// never by a name in the message).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/metadata.h"
#include "transport/path.h"
#include "transport/ucx.h"

namespace kvmove {

class UcxPath : public Path {
public:
    // Throws PeerError when the endpoint cannot be made, MetadataError when a remote key of
    // `peer` does not unpack. on_error(error_arg, ...) runs when UCX declares the peer dead.
    UcxPath(ucp_worker_h worker, const AgentMetadata& peer, bool peer_errors,
            ucp_err_handler_cb_t on_error, void* error_arg);
    UcxPath(const UcxPath&) = delete;
    UcxPath& operator=(const UcxPath&) = delete;

    const char* kind() const override { return "ucx"; }
    ucp_ep_h endpoint() const override { return endpoint_->get(); }
    std::vector<std::pair<std::string, std::string>> transports() const override {
        return endpoint_->transports();
    }
    void post(PathBatch batch, PathDone done) override;
    void send(unsigned am_id, std::string message, bool rendezvous, PathDone done) override;
    void close(bool force, double timeout_seconds) override;

private:
    static void on_complete(void* request, ucs_status_t status, void* user_data);

    // Declared in dependency order: the keys are destroyed before their endpoint.
    std::unique_ptr<Endpoint> endpoint_;
    std::vector<RkeyPtr> rkeys_;  // one per segment of the peer's metadata
};

// How a UCX status ends a transfer: a peer that went away is a PeerError, anything else a
// TransferError.
PortOutcome outcome_of(ucs_status_t status);

}  // namespace kvmove
