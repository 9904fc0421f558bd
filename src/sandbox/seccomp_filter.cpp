// Builds the sandbox's seccomp filter with libseccomp and exports it as raw BPF for bwrap.
//
// Default allow, then deny what an honest test program never needs: kernel attack surface (ptrace, mount,
// namespaces, keyrings, bpf, perf) and network sockets. Unix sockets stay allowed: some runtimes use them
// internally and the network namespace already isolates them.
#include "seccomp_filter.hpp"

#include <sched.h>
#include <seccomp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>

#include <rlloop/error.hpp>

namespace rlloop::sandbox::detail {
namespace {

void add(scmp_filter_ctx ctx, uint32_t action, int nr) {
  if (nr < 0) return;  // not a syscall on this architecture
  if (seccomp_rule_add(ctx, action, nr, 0) != 0) throw error("sandbox: seccomp_rule_add failed");
}

std::string build(bool allow_fork) {
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (!ctx) throw error("sandbox: seccomp_init failed");
  struct Guard {
    scmp_filter_ctx c;
    ~Guard() { seccomp_release(c); }
  } guard{ctx};

  const uint32_t deny = SCMP_ACT_ERRNO(EPERM);
  for (int nr : {SCMP_SYS(ptrace),
                 SCMP_SYS(process_vm_readv),
                 SCMP_SYS(process_vm_writev),
                 SCMP_SYS(mount),
                 SCMP_SYS(umount2),
                 SCMP_SYS(pivot_root),
                 SCMP_SYS(chroot),
                 SCMP_SYS(unshare),
                 SCMP_SYS(setns),
                 SCMP_SYS(keyctl),
                 SCMP_SYS(add_key),
                 SCMP_SYS(request_key),
                 SCMP_SYS(bpf),
                 SCMP_SYS(perf_event_open),
                 SCMP_SYS(userfaultfd),
                 SCMP_SYS(kexec_load),
                 SCMP_SYS(init_module),
                 SCMP_SYS(finit_module),
                 SCMP_SYS(delete_module),
                 SCMP_SYS(reboot),
                 SCMP_SYS(swapon),
                 SCMP_SYS(swapoff),
                 SCMP_SYS(acct),
                 SCMP_SYS(setsid),
                 SCMP_SYS(setpgid)})
    add(ctx, deny, nr);

  // Only Unix-domain sockets.
  if (seccomp_rule_add(ctx, deny, SCMP_SYS(socket), 1, SCMP_A0(SCMP_CMP_NE, AF_UNIX)) != 0)
    throw error("sandbox: seccomp socket rule failed");

  if (!allow_fork) {
    add(ctx, deny, SCMP_SYS(fork));
    add(ctx, deny, SCMP_SYS(vfork));
    // No threads either: RLIMIT_NPROC counts threads per uid, and all sandboxes share one uid, so a thread
    // bomb in one run could starve the others. Test programs run single-threaded.
    add(ctx, deny, SCMP_SYS(clone));
    // clone3 passes its flags in memory, which seccomp cannot read: ENOSYS makes libc fall back to clone(2).
    add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3));
  }

  int fd = ::memfd_create("rlloop-seccomp", MFD_CLOEXEC);
  if (fd < 0) throw error("sandbox: memfd_create failed");
  std::string bytes;
  if (seccomp_export_bpf(ctx, fd) == 0) {
    off_t size = ::lseek(fd, 0, SEEK_END);
    bytes.resize(static_cast<std::size_t>(size));
    if (::pread(fd, bytes.data(), bytes.size(), 0) != size) bytes.clear();
  }
  ::close(fd);
  if (bytes.empty()) throw error("sandbox: exporting the seccomp filter failed");
  return bytes;
}

}  // namespace

const std::string& seccomp_bpf(bool allow_fork) {
  static const std::string with_fork = build(true);
  static const std::string without_fork = build(false);
  return allow_fork ? with_fork : without_fork;
}

}  // namespace rlloop::sandbox::detail
