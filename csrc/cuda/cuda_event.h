// CUDA events as the core sees them: an opaque handle (cudaEvent_t) it can poll.
//
// save_layer(i, event) hands the core the event recorded after layer i's KV was written; a
// core thread polls it and posts the layer once the GPU got there, so neither the forward
// pass nor Python ever waits. Only the CUDA build can poll; the CPU build says so.
#pragma once

#include <cstdint>

namespace kvmove {

// True when this build can poll CUDA events (compiled with KVMOVE_CUDA=1).
bool cuda_events_supported();

// True once all work recorded before the event has completed, false while it is pending.
// Throws CudaError for an invalid handle or a device error.
bool cuda_event_done(uintptr_t event);

}  // namespace kvmove
