#include "transport/ucx.h"

#include <ucs/debug/log_def.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "common/log.h"

namespace kvmove {

namespace {

struct ConfigDeleter {
    void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};

// UCX prints its log to stdout by default, which corrupts the output of CLIs that print JSON.
// This handler takes every message UCX's level lets through (UCX_LOG_LEVEL) into kvmove's log
// (logger "kvmove.ucx"); a fatal one also goes to stderr at once, as the process is about to
// end before anyone drains the log.
ucs_log_func_rc_t log_to_kvmove(const char* file, unsigned line, const char*, ucs_log_level_t level,
                                const ucs_log_component_config_t*, const char* format, va_list ap) {
    char message[1024];
    std::vsnprintf(message, sizeof message, format, ap);
    const char* base = std::strrchr(file, '/');
    base = base != nullptr ? base + 1 : file;
    if (level <= UCS_LOG_LEVEL_FATAL) {
        std::fprintf(stderr, "[ucx %s] %s:%u %s\n", ucs_log_level_names[level], base, line,
                     message);
    }
    const LogLevel kvmove_level = level <= UCS_LOG_LEVEL_ERROR  ? LogLevel::Error
                                  : level <= UCS_LOG_LEVEL_WARN ? LogLevel::Warning
                                  : level <= UCS_LOG_LEVEL_DIAG ? LogLevel::Info
                                                                : LogLevel::Debug;
    KVMOVE_LOG_AT(kvmove_level, "ucx", base << ":" << line << " " << message);
    return UCS_LOG_FUNC_RC_STOP;
}

// Applies a UCX setting unless the user's environment sets it (UCX_<key>): an expert's
// explicit choice wins over kvmove's default.
void modify_unless_set(ucp_config_t* config, const std::string& key, const std::string& value) {
    if (std::getenv(("UCX_" + key).c_str()) != nullptr) {
        return;
    }
    KVMOVE_UCX_CHECK(ucp_config_modify(config, key.c_str(), value.c_str()),
                     "cannot set UCX " << key << "=" << value);
}

}  // namespace

std::string ucx_version() {
    return ucp_get_version_string();
}

std::vector<std::pair<std::string, std::string>> peer_error_settings() {
    // In PEER error mode UCX (1.22, ucp/wireup/select.c) keeps only transports that report a
    // dead peer, and while rendezvous is enabled its bandwidth lanes must also support RMA
    // memory invalidation. On one host that left tcp alone (lanes "rma_am(tcp/lo) am(tcp/lo)
    // ka(tcp/lo)": every put emulated over a socket, 1.9 GB/s):
    // - cma reports a dead peer (ep_check of its pid) but cannot invalidate memory. kvmove
    //   sends every active message eager (Agent::sender_of drops rendezvous ones), so turning
    //   rendezvous off costs nothing, and cma then carries puts and gets, zero-copy.
    // - posix/sysv check their peer's pid the same way (ep_check), but advertise peer-failure
    //   handling only with MM_ERROR_HANDLING; with it, notifications and stream messages go
    //   through shared memory instead of tcp/lo.
    // The lanes are then NONE mode's, with a keepalive: "rma(sysv/memory posix/memory)
    // am(sysv/memory cma/memory) ka(sysv/memory)". docs/transfer.md has the measurements.
    return {{"RNDV_THRESH", "inf"}, {"MM_ERROR_HANDLING", "y"}};
}

std::vector<std::pair<std::string, std::string>> tcp_settings() {
    // UCX's tcp transport has no get: UCX (1.22) serves a get over tcp as an active message
    // whose reply the peer sends back in bcopy segments of TX_SEG_SIZE, 8 KiB by default, each
    // a copy and a send of its own. Reads over tcp ran at a fifth of writes (ucx_perftest,
    // loopback, 4 MiB: ucp_get 1.12-1.18 GB/s, ucp_put_bw 5.35-5.61). With 512 KiB segments
    // (and a receive buffer that holds two) ucp_get ran at 6.8 GB/s in the same session, puts
    // unchanged (5.55), one-way latency of a 64-byte message unchanged (7.1 us); 64 KiB gets
    // (one outstanding) gain nothing, being a round trip each. A segment is allocated only
    // while a message is in flight, so idle endpoints cost no more.
    return {{"TCP_TX_SEG_SIZE", "512K"}, {"TCP_RX_SEG_SIZE", "1M"}};
}

ContextPtr make_context(const std::string& transports, double keepalive_seconds,
                        const std::string& net_devices, bool peer_errors) {
    static std::once_flag log_handler_installed;
    std::call_once(log_handler_installed, [] { ucs_log_push_handler(&log_to_kvmove); });
    ucp_config_t* raw = nullptr;
    KVMOVE_UCX_CHECK(ucp_config_read(nullptr, nullptr, &raw), "cannot read UCX configuration");
    std::unique_ptr<ucp_config_t, ConfigDeleter> config(raw);
    if (!transports.empty()) {
        KVMOVE_UCX_CHECK(ucp_config_modify(config.get(), "TLS", transports.c_str()),
                         "cannot select UCX transports '" << transports << "'");
    }
    if (!net_devices.empty()) {
        KVMOVE_UCX_CHECK(ucp_config_modify(config.get(), "NET_DEVICES", net_devices.c_str()),
                         "cannot restrict UCX to the devices '" << net_devices << "'");
    }
    std::ostringstream keepalive;
    keepalive << keepalive_seconds << "s";
    KVMOVE_UCX_CHECK(ucp_config_modify(config.get(), "KEEPALIVE_INTERVAL", keepalive.str().c_str()),
                     "cannot set UCX keepalive interval " << keepalive.str());
    for (const auto& [key, value] : tcp_settings()) {
        modify_unless_set(config.get(), key, value);
    }
    if (peer_errors) {
        for (const auto& [key, value] : peer_error_settings()) {
            modify_unless_set(config.get(), key, value);
        }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    ucp_context_h context = nullptr;
    KVMOVE_UCX_CHECK(ucp_init(&params, config.get(), &context),
                     "cannot initialise UCX with transports '" << transports << "'");
    return ContextPtr(context);
}

WorkerPtr make_worker(ucp_context_h context) {
    ucp_worker_params_t params{};
    params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    ucp_worker_h worker = nullptr;
    KVMOVE_UCX_CHECK(ucp_worker_create(context, &params, &worker), "cannot create a UCX worker");
    return WorkerPtr(worker);
}

std::vector<uint8_t> worker_address(ucp_worker_h worker) {
    ucp_address_t* addr = nullptr;
    size_t nbytes = 0;
    KVMOVE_UCX_CHECK(ucp_worker_get_address(worker, &addr, &nbytes),
                     "cannot get the UCX worker address");
    auto bytes = reinterpret_cast<const uint8_t*>(addr);
    std::vector<uint8_t> out(bytes, bytes + nbytes);
    ucp_worker_release_address(worker, addr);
    return out;
}

MemoryRegistration::MemoryRegistration(ucp_context_h context, void* addr, size_t nbytes, bool cuda)
    : context_(context) {
    ucp_mem_map_params_t params{};
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = addr;
    params.length = nbytes;
    if (cuda) {
        params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        params.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    KVMOVE_UCX_CHECK(ucp_mem_map(context_, &params, &memh_),
                     "cannot register " << nbytes << " bytes at " << addr << " with UCX");
    void* rkey = nullptr;
    size_t rkey_nbytes = 0;
    ucs_status_t status = ucp_rkey_pack(context_, memh_, &rkey, &rkey_nbytes);
    if (status != UCS_OK) {
        ucp_mem_unmap(context_, memh_);
        KVMOVE_UCX_CHECK(status, "cannot pack the remote key of a " << nbytes << "-byte region");
    }
    auto bytes = static_cast<const uint8_t*>(rkey);
    packed_rkey_.assign(bytes, bytes + rkey_nbytes);
    ucp_rkey_buffer_release(rkey);
}

MemoryRegistration::~MemoryRegistration() {
    ucp_mem_unmap(context_, memh_);
}

Endpoint::Endpoint(ucp_worker_h worker, const std::vector<uint8_t>& address, bool peer_errors,
                   ucp_err_handler_cb_t on_error, void* error_arg)
    : worker_(worker) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    params.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = on_error;
    params.err_handler.arg = error_arg;
    KVMOVE_UCX_CHECK(ucp_ep_create(worker_, &params, &ep_), "cannot create a UCX endpoint");
}

Endpoint::~Endpoint() {
    close(true, 5.0);
}

void Endpoint::close(bool force, double timeout_seconds) {
    if (ep_ == nullptr) {
        return;
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t request = ucp_ep_close_nbx(ep_, &param);
    ep_ = nullptr;
    if (request == nullptr || UCS_PTR_IS_ERR(request)) {
        return;
    }
    auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
    while (ucp_request_check_status(request) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < deadline) {
        ucp_worker_progress(worker_);
    }
    ucp_request_free(request);  // released by UCX when done, if it is not yet
}

RkeyPtr Endpoint::unpack_rkey(const std::vector<uint8_t>& packed) const {
    ucp_rkey_h rkey = nullptr;
    KVMOVE_UCX_CHECK(ucp_ep_rkey_unpack(ep_, packed.data(), &rkey),
                     "cannot unpack a " << packed.size() << "-byte remote key");
    return RkeyPtr(rkey);
}

std::vector<std::pair<std::string, std::string>> Endpoint::transports() const {
    std::vector<std::pair<std::string, std::string>> out;
    if (ep_ == nullptr) {
        return out;
    }
#if UCP_API_VERSION >= UCP_VERSION(1, 14)
    constexpr size_t kMaxLanes = 64;  // UCP_MAX_LANES is 64 at most
    std::vector<ucp_transport_entry_t> entries(kMaxLanes);
    ucp_ep_attr_t attr{};
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries.data();
    attr.transports.num_entries = static_cast<unsigned>(entries.size());
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    KVMOVE_UCX_CHECK(ucp_ep_query(ep_, &attr), "cannot query a UCX endpoint's transports");
    for (unsigned i = 0; i < attr.transports.num_entries; ++i) {
        std::pair<std::string, std::string> pair{entries[i].transport_name, entries[i].device_name};
        if (std::find(out.begin(), out.end(), pair) == out.end()) {
            out.push_back(std::move(pair));
        }
    }
#endif  // UCX before 1.14 cannot tell an endpoint's lanes: none reported
    return out;
}

std::string ucx_built_version() {
    return std::to_string(UCP_API_MAJOR) + "." + std::to_string(UCP_API_MINOR);
}

}  // namespace kvmove
