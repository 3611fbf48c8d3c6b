// Fault injection in the Agent's own post path: how the tests prove that no fault leads to
// wrong KV being served (the idea of Mooncake's FaultProxyTransport and vLLM's UCX fault
// injector, without a proxy: the faults happen where kvmove posts).
//
// Off by default; an Agent holds no injector then, and every check is one null test. On with
// Agent(..., faults="...") or KVMOVE_FAULTS, a comma-separated list:
//
//   seed=N              seeds the random choices (default 0)
//   fail_post=N         every Nth layer or transfer post fails, as if UCX refused it
//   delay_post_us=X     each layer waits X microseconds before it is posted (a slow sender)
//   drop_message=P      each stream message (Begin, Go, Layer, Final, Ack, Abort, Cancel...)
//                       or notification is dropped with probability P, reported as sent
//   delay_message_ms=X  each stream message or notification goes out X milliseconds late
//   corrupt_every=N     every Nth layer put lands with one byte flipped (after its own puts,
//                       before its Layer message), which the checksums must catch
//   rndv_messages=1     every stream message and notification goes as a rendezvous (a peer
//                       that does not follow kvmove's protocol), which receivers must drop
//
// Counts of what was injected: counts().
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <string>

namespace kvmove {

struct FaultConfig {
    uint64_t seed = 0;
    uint64_t fail_post_every = 0;
    double delay_post_us = 0;
    double drop_message = 0;
    double delay_message_ms = 0;
    uint64_t corrupt_every = 0;
    bool rndv_messages = false;

    bool any() const;
};

// Throws ConfigError naming the bad entry.
FaultConfig parse_faults(const std::string& spec);

class FaultInjector {
public:
    explicit FaultInjector(FaultConfig config);

    const FaultConfig& config() const { return config_; }
    bool fail_post();                // this post fails
    double post_delay_seconds();     // wait this long before posting a layer
    bool drop_message();             // this message is dropped
    double message_delay_seconds();  // send this message this much later
    bool corrupt_layer();            // flip a byte of this layer's put
    bool rndv_message();             // send this message as a rendezvous
    std::map<std::string, uint64_t> counts() const;

private:
    bool chance(double p);

    const FaultConfig config_;
    mutable std::mutex mu_;
    std::mt19937_64 random_;
    uint64_t posts_ = 0;
    uint64_t layers_ = 0;
    std::map<std::string, uint64_t> counts_;
};

}  // namespace kvmove
