// UCX: RAII owners for UCP handles, the check macro, and what kvmove knows of the library.
//
// Each handle has exactly one owner; an Agent declares them in dependency order (context,
// worker, memory registration, endpoints, remote keys) so they are destroyed in reverse:
// keys and endpoints before the worker, the worker before the context.
#pragma once

#include <ucp/api/ucp.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"

// KVMOVE_UCX_CHECK(ucp_call(...), "what failed " << value): throws UCXError with UCX's status
// string unless the call returned UCS_OK.
#define KVMOVE_UCX_CHECK(expr, stream_expr)                                                   \
    do {                                                                                      \
        ucs_status_t kvmove_ucx_status_ = (expr);                                             \
        KVMOVE_CHECK(                                                                         \
            kvmove_ucx_status_ == UCS_OK, Ucx,                                                \
            stream_expr << ": " #expr " returned " << ucs_status_string(kvmove_ucx_status_)); \
    } while (0)

namespace kvmove {

// The version of the libucp actually loaded, e.g. "1.22.0".
std::string ucx_version();
// The UCX API version kvmove was compiled against, "MAJOR.MINOR" (the loaded one must not be
// older).
std::string ucx_built_version();

// One transport resource UCX offers here: component ("tcp", "ib", "cuda_ipc"), memory domain,
// transport ("tcp", "rc_mlx5", "posix"), device ("eth0", "mlx5_0:1", "memory") and the
// device's kind ("net", "shm", "acc", "self").
struct UcxResource {
    std::string component, memory_domain, transport, device, device_type;
};
// Every resource of every memory domain that opens here (ucx_inventory.cpp).
std::vector<UcxResource> ucx_resources();
// The path of the libucp this process loaded ("" where the loader cannot tell).
std::string ucx_library();

struct ContextDeleter {
    void operator()(ucp_context_h c) const { ucp_cleanup(c); }
};
struct WorkerDeleter {
    void operator()(ucp_worker_h w) const { ucp_worker_destroy(w); }
};
struct RkeyDeleter {
    void operator()(ucp_rkey_h k) const { ucp_rkey_destroy(k); }
};
using ContextPtr = std::unique_ptr<std::remove_pointer_t<ucp_context_h>, ContextDeleter>;
using WorkerPtr = std::unique_ptr<std::remove_pointer_t<ucp_worker_h>, WorkerDeleter>;
using RkeyPtr = std::unique_ptr<std::remove_pointer_t<ucp_rkey_h>, RkeyDeleter>;

// A UCP context with RMA and active messages. transports: UCX_TLS syntax, empty = UCX's choice;
// net_devices: UCX_NET_DEVICES syntax ("lo", "eth0,mlx5_0:1"), empty = every device (UCX's
// tcp transport then listens on every interface).
// peer_errors: endpoints will use UCP_ERR_HANDLING_MODE_PEER; the context then also gets
// peer_error_settings(), so that on one host that mode keeps shared memory and cma. Every context
// gets tcp_settings().
ContextPtr make_context(const std::string& transports, double keepalive_seconds,
                        const std::string& net_devices, bool peer_errors);
// The UCX settings (key without "UCX_", value) kvmove adds for PEER error mode; a UCX_<key>
// in the environment overrides its entry.
std::vector<std::pair<std::string, std::string>> peer_error_settings();
// The UCX settings (key without "UCX_", value) kvmove adds to every context for its tcp
// transport; a UCX_<key> in the environment overrides its entry.
std::vector<std::pair<std::string, std::string>> tcp_settings();
// A worker whose calls the caller serializes (UCS_THREAD_MODE_SERIALIZED).
WorkerPtr make_worker(ucp_context_h context);
std::vector<uint8_t> worker_address(ucp_worker_h worker);

// Memory registered with a context, and its packed remote key. cuda: device memory (UCX is told
// so instead of probing the pointer, and picks cuda_ipc / GPUDirect RDMA / cuda_copy for it).
class MemoryRegistration {
public:
    MemoryRegistration(ucp_context_h context, void* addr, size_t nbytes, bool cuda = false);
    ~MemoryRegistration();
    MemoryRegistration(const MemoryRegistration&) = delete;
    MemoryRegistration& operator=(const MemoryRegistration&) = delete;

    const std::vector<uint8_t>& packed_rkey() const { return packed_rkey_; }

private:
    ucp_context_h context_;
    ucp_mem_h memh_ = nullptr;
    std::vector<uint8_t> packed_rkey_;
};

// An endpoint to a peer's worker.
class Endpoint {
public:
    Endpoint(ucp_worker_h worker, const std::vector<uint8_t>& address, bool peer_errors,
             ucp_err_handler_cb_t on_error, void* error_arg);
    ~Endpoint();
    Endpoint(const Endpoint&) = delete;
    Endpoint& operator=(const Endpoint&) = delete;

    ucp_ep_h get() const { return ep_; }
    RkeyPtr unpack_rkey(const std::vector<uint8_t>& packed) const;
    // The (transport, device) pairs UCX chose for this endpoint's lanes, each once, in lane
    // order, e.g. {"sysv", "memory"}, {"cma", "memory"}; empty once closed, and always with a
    // UCX older than 1.14 (which cannot tell).
    std::vector<std::pair<std::string, std::string>> transports() const;
    // Graceful (force = false) flushes outstanding operations and says goodbye, so the peer
    // never acknowledges into a vanished connection; force cancels them, for a dead peer.
    // Progresses the worker until done or timeout_seconds pass. Idempotent.
    void close(bool force, double timeout_seconds);

private:
    ucp_worker_h worker_;
    ucp_ep_h ep_ = nullptr;
};

}  // namespace kvmove
