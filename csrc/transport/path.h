// Path: how one peer's bytes and messages move. The Agent keeps one per peer and never asks
// which kind it holds: it validates a transfer, pairs its ranges (common/kv_geometry.h) and
// posts them on the peer's path; it learns from a callback when they landed.
//
//   UcxPath     one-sided UCX puts/gets of the ranges and a flush (transport/ucx_path.h)
//   MappedPath  a same-host peer whose memory is mapped here: one copy job on the agent's copy
//               threads (transport/mapped_path.h); its messages still go by UCX
//   FaultyPath  any path with faults injected (transport/faulty_path.h): the only place the
//               data path knows about fault injection
//
// The promises every path keeps, which the agent's notification order and the stream protocol
// rest on:
//   - a batch's `done` runs once, when every byte of it is in place on the destination side
//     (or it failed), and never before the `done` of a batch posted earlier on the same path;
//   - a message is delivered after the messages sent before it on the same path;
//   - `done` runs on the agent's progress (with its lock held), possibly inside a UCX callback
//     and possibly inside post() itself (a post that fails at once): it must only record the
//     outcome, never post or send.
//
// Threads: every call is made with the agent's worker lock held (stream/stream_port.h).
#pragma once

#include <ucp/api/ucp.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/kv_geometry.h"
#include "stream/stream_port.h"
#include "transport/copier.h"

namespace kvmove {

enum class Direction { Put, Get };

// One transfer's ranges (here: this agent's memory, there: the peer's), in one direction.
struct PathBatch {
    Direction direction = Direction::Put;
    std::vector<RangePair> ranges;
    // The receiver's lease this batch is one layer of a stream into (0: no stream's); fault
    // injection corrupts such batches, and cancel_lease() stops them.
    uint64_t lease = 0;
    // Checksums to compute with the copies (only on a path that checksums_on_copy(): the
    // agent computes them itself for any other), each of a range here. Their outputs live in
    // what `keep` holds.
    std::vector<HashOp> checksums;
    std::shared_ptr<const void> keep;
    // What the transfer is for: the mapped path's copy threads run a hand-off's chunks before
    // an offload's (transport/copier.h). Batches to one peer still complete in posting order.
    TrafficClass traffic = TrafficClass::Handoff;
};

// How a batch or a message ended (PortOutcome: ok, or the error and whether the peer is gone).
using PathDone = std::function<void(const PortOutcome&)>;

class Path {
public:
    virtual ~Path() = default;

    // "ucx" or "mapped": how the bytes move (Agent::peer_path).
    virtual const char* kind() const = 0;
    // The endpoint the peer's messages come by (the agent attributes them by it).
    virtual ucp_ep_h endpoint() const = 0;
    // The (transport, device) pairs UCX chose for the endpoint (Endpoint::transports).
    virtual std::vector<std::pair<std::string, std::string>> transports() const = 0;

    virtual void post(PathBatch batch, PathDone done) = 0;
    // Whether post() computes a batch's checksums (PathBatch::checksums) as it copies: the
    // mapped path's copy threads do, reading each source byte while it is in their caches.
    virtual bool checksums_on_copy() const { return false; }
    // An active message of am_id; rendezvous: sent as UCX rendezvous, which receivers drop
    // (fault injection: a peer that does not follow kvmove's protocol).
    virtual void send(unsigned am_id, std::string message, bool rendezvous, PathDone done) = 0;

    // Outside UCX callbacks: completes what finished since (copies, held messages). Returns
    // whether anything is still pending that only poll() completes.
    virtual bool poll(double /*now*/) { return false; }
    // The steady-clock moment poll() has something due (infinity: none).
    virtual double next_deadline() const { return std::numeric_limits<double>::infinity(); }
    // False, with why, once the peer's process is known dead by other means than UCX's own
    // error callback (a mapped peer's pidfd).
    virtual bool alive(std::string& /*why*/) const { return true; }
    // The peer failed or goes: what is in flight stops as soon as it can, and completes
    // failed. Idempotent.
    virtual void cancel() {}
    // The receiver cancelled `lease`: its batches not yet under way are dropped (they
    // complete failed). What a transport already carries (UCX's posted puts) still lands.
    virtual void cancel_lease(uint64_t /*lease*/) {}
    // Closes the connection (force: cancels what is posted; else flushes it first), progressing
    // the worker for at most timeout_seconds. Once it returns, nothing the peer posts reaches
    // this process. Idempotent.
    virtual void close(bool force, double timeout_seconds) = 0;
};

// A path around another (FaultyPath, PacedPath): whatever it does not change, the inner path
// does.
class WrappingPath : public Path {
public:
    explicit WrappingPath(std::unique_ptr<Path> inner) : inner_(std::move(inner)) {}

    const char* kind() const override { return inner_->kind(); }
    ucp_ep_h endpoint() const override { return inner_->endpoint(); }
    std::vector<std::pair<std::string, std::string>> transports() const override {
        return inner_->transports();
    }
    void post(PathBatch batch, PathDone done) override {
        inner_->post(std::move(batch), std::move(done));
    }
    bool checksums_on_copy() const override { return inner_->checksums_on_copy(); }
    void send(unsigned am_id, std::string message, bool rendezvous, PathDone done) override {
        inner_->send(am_id, std::move(message), rendezvous, std::move(done));
    }
    bool poll(double now) override { return inner_->poll(now); }
    double next_deadline() const override { return inner_->next_deadline(); }
    bool alive(std::string& why) const override { return inner_->alive(why); }
    void cancel() override { inner_->cancel(); }
    void cancel_lease(uint64_t lease) override { inner_->cancel_lease(lease); }
    void close(bool force, double timeout_seconds) override {
        inner_->close(force, timeout_seconds);
    }

protected:
    std::unique_ptr<Path> inner_;
};

}  // namespace kvmove
