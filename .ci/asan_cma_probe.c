// Preloaded before ASan by .ci/hardening: UCX's cma transport probes whether it may read a peer
// (uct_cma_iface_is_reachable_v2) with process_vm_readv of 16 bytes from the peer's address
// NULL into our NULL. ASan's interceptor checks the local buffer of any read that returns > 0;
// in two CI runs so far a probe returned > 0 and ASan crashed the process reading
// the shadow of NULL, inside UCX's probe, with no kvmove frame in the stack. The probe (one
// local buffer at NULL, which no transfer has) goes straight to the kernel; every other call
// goes on to ASan's interceptor, which keeps checking UCX's real cma reads into kvmove's memory.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

typedef ssize_t (*readv_fn)(pid_t, const struct iovec*, unsigned long, const struct iovec*,
                            unsigned long, unsigned long);

ssize_t process_vm_readv(pid_t pid, const struct iovec* local, unsigned long local_count,
                         const struct iovec* remote, unsigned long remote_count,
                         unsigned long flags) {
    if (local_count == 1 && local[0].iov_base == NULL) {
        return syscall(SYS_process_vm_readv, pid, local, local_count, remote, remote_count,
                       flags);
    }
    static readv_fn next;
    if (next == NULL) {
        next = (readv_fn)dlsym(RTLD_NEXT, "process_vm_readv");
    }
    return next(pid, local, local_count, remote, remote_count, flags);
}
