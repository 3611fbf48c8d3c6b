// Driver: lets a thread that waits for a transport's result progress the transport itself
// (transport/agent_progress.cpp), instead of sleeping until another thread has done it.
#pragma once

#include <functional>

namespace kvmove {

class Driver {
public:
    virtual ~Driver() = default;
    // Progresses until done() is true, timeout_seconds pass, or the transport closes; done()
    // runs on this thread, without the transport's locks.
    virtual void progress_until(const std::function<bool()>& done, double timeout_seconds) = 0;
};

}  // namespace kvmove
