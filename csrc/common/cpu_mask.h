// The CPUs a thread may run on, captured where an object is built and applied by the threads
// it starts later.
//
// A thread inherits its creator's affinity, and kvmove starts some threads on first use: a
// stream's post thread on the first save_layer, the copy threads on the first mapped put, the
// verify thread on the first checksummed layer. Whatever thread used them first gave them its
// CPUs: an engine's model thread, pinned to its own cores, so the threads moving its KV
// queued behind its forward passes (kvmove-serve: a prefill's post and copy threads on the
// core of the model thread). They take the CPUs of the thread that built their owner instead
// (an engine builds its agent unpinned: kvmove.runtime.unpinned), like the progress thread.
#pragma once

#include <sched.h>

namespace kvmove {

class CpuMask {
public:
    static CpuMask of_this_thread() {
        CpuMask mask;
        mask.valid_ = sched_getaffinity(0, sizeof(mask.set_), &mask.set_) == 0;
        return mask;
    }

    // Best effort: a set the kernel refuses now (a cpuset shrunk meanwhile) leaves the
    // calling thread as it was.
    void apply() const {
        if (valid_) {
            sched_setaffinity(0, sizeof(set_), &set_);
        }
    }

private:
    cpu_set_t set_{};
    bool valid_ = false;
};

}  // namespace kvmove
