// Cross-process tier lock and run lock.
//
// TierLock design: a ticket lock built from open-file-description (OFD) byte
// range locks on one file, `<lock_path>.tickets`.
//  - Taking a ticket: under a write lock on byte 0 (a short critical section),
//    read the counter stored in the file's first 8 bytes, write-lock byte
//    kTicketBase + t for our ticket t, and store t + 1.
//  - Waiting: ticket t may enter once ticket t - K has left, so it asks for a
//    read lock on byte kTicketBase + t - K with F_OFD_SETLKW, which sleeps in
//    the kernel until the holder of t - K unlocks it (Release, close or death)
//    and is then dropped at once.
//  - Entering: ticket t writes t + 1 into its mark slot (the 8 bytes at
//    kMarkBase + 8 * (t mod M), M a multiple of K) before Acquire returns.
//    A waiter granted its predecessor's byte checks that mark: a predecessor
//    that died (or failed) while waiting released its byte without entering,
//    while the one it waited for may still hold the lock, so the waiter goes
//    on to wait for t - 2K, and so on, until a predecessor that entered (and
//    so left, as its byte was granted) or the start of its lane. The slot of
//    t - K is next written by t - K + M, a later ticket of t's own lane, which
//    cannot enter before t.
//  - Releasing: unlock byte kTicketBase + t.
// Why this gives the guarantees:
//  - at most K holders: tickets with the same residue mod K form a chain in
//    which each enters only after the last of its predecessors that entered
//    left, so each residue has at most one holder at a time;
//  - FIFO and no starvation: tickets are handed out in arrival order and each
//    waits only for a finite chain of earlier tickets (K round-robin lanes; a
//    lane does not lend its turn to another, which costs some utilisation when
//    hold times differ widely but never starves anyone);
//  - no busy waiting: the kernel's lock wait queue does the sleeping. A wait
//    with a deadline (Acquire's timeout: a holder that is alive but stopped
//    would keep its byte for ever) or a cancel flag still sleeps there, on a
//    helper thread of its own (F_OFD_SETLKW takes neither: see
//    WaitInKernel), so a turn is handed over as soon as it ends; only the
//    ticket counter's short critical section is polled;
//  - death: the kernel drops every lock of a process's OFDs when it dies, so a
//    SIGKILLed holder (or waiter, or a process that died while taking a
//    ticket) releases its byte and the chain moves on.
// OFD locks rather than classic POSIX locks because those are per process:
// two TierLock objects in one process would not exclude each other, and
// closing any descriptor of the file would drop all of them. Every process
// sharing a tier must use the same K.
//
// The last user removes the file (so lock directories do not fill up with
// one file per tier ever used), without ever splitting the queue in two:
//  - every open TierLock holds a read lock on the presence byte 1, taken
//    right after open(); it then checks that the path still names the file
//    it opened (dev, inode), and opens again if not (the file was removed
//    between its open() and its lock);
//  - on destruction it tries to turn that read lock into a write lock
//    without waiting, which succeeds only if no other TierLock has the file
//    open, and then unlinks the file before closing it. A process that
//    opened the file meanwhile waits for that write lock, sees the file gone
//    and opens the new one; a process still holding or waiting for a ticket
//    holds its presence lock, so the file stays.
// A child forked without exec shares its parent's open file descriptions:
// only the process that opened the lock removes the file.
#include "io/tier_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "io/file.h"
#include "io/internal/ofd_lock.h"
#include "io/internal/poll.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/status_macros.h"
#include "mlp_offload/base/threads.h"

namespace mlp_offload {
namespace {

// Byte 0 guards the ticket counter; byte 1 is the presence lock; ticket t is
// byte kTicketBase + t. Lock ranges may lie far beyond EOF: the file holds the
// counter (8 bytes) and the entered marks, M = K * kMarkLanes slots of 8 bytes
// from kMarkBase.
constexpr off_t kPresenceByte = 1;
constexpr off_t kTicketBase = 4096;
constexpr off_t kMarkBase = 8;
constexpr int64_t kMarkLanes = 16;

using internal_io::OfdLock;

// A wait's limit (Acquire's timeout), when it runs out, and its cancel flag.
struct Deadline {
  Deadline(absl::Duration t, const std::atomic<bool>* c)
      : timeout(t), cancel(c) {
    if (t != absl::InfiniteDuration()) at = MonoAfter(t);
  }
  // Whether the wait has a limit or a flag, which F_OFD_SETLKW on the
  // waiting thread cannot honour: it waits through a helper (WaitInKernel)
  // or polls (OfdLockUntil).
  bool polls() const { return at.has_value() || cancel != nullptr; }
  // The call a failed wait names.
  const char* Call() const {
    return polls() ? "fcntl(F_OFD_SETLK, polled)" : "fcntl(F_OFD_SETLKW)";
  }
  absl::Duration timeout;
  std::optional<MonoTime> at;       // none: no limit
  const std::atomic<bool>* cancel;  // null: none
};

// OfdLock that waits until `deadline` at most (unbounded and without a
// cancel flag: the kernel's wait). Otherwise it polls (PollWithBackoff), so
// a release (or the flag) is seen within 2 ms. ETIMEDOUT when the deadline
// passed, ECANCELED when the flag is set.
int OfdLockUntil(int fd, short type, off_t offset, const Deadline& deadline) {
  if (!deadline.polls()) return OfdLock(fd, type, offset, /*wait=*/true);
  return internal_io::PollWithBackoff(
      [&] {
        const int err = OfdLock(fd, type, offset, /*wait=*/false);
        return err == EACCES ? EAGAIN : err;  // held by another: try again
      },
      deadline.at, deadline.cancel);
}

// What a wait shares with the helper thread that sleeps in the kernel for it
// (and may outlive it: see WaitInKernel).
struct KernelWait {
  off_t offset = 0;  // the byte it waits for
  Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  int err ABSL_GUARDED_BY(mu) = 0;
};

// How often a wait in the kernel looks at its cancel flag.
constexpr absl::Duration kCancelCheck = absl::Milliseconds(10);

int StartHelper(int fd, const std::shared_ptr<KernelWait>& wait);
int AwaitHelper(KernelWait& wait, const Deadline& deadline);

// Waits until a read lock on byte `offset` of the file open as `fd` is
// granted, then drops it (the grant is the signal that its holder left), in
// the kernel's lock wait queue, yet ending at `deadline` or when its cancel
// flag is set (seen within 10 ms). F_OFD_SETLKW takes neither, so a helper
// thread makes the call, on an open file description of its own (the file
// opened again through /proc/self/fd: the same file, whatever its path names
// now), and tells the caller. A wait that ends early leaves its helper asleep
// until the lock is granted (a read lock on a byte that only its ticket's
// owner ever write-locks holds up no one), which then drops it and ends.
// Returns as OfdLockUntil, or -1 where no helper could be made (no /proc, no
// thread): the caller then polls. A lock that is free is taken on `fd` at
// once, without a helper. `left` is the helper an earlier wait that ended
// early left behind (or null), and receives this one's: a wait for the same
// byte (a retry: its new ticket waits, past the abandoned one, for the same
// predecessor) takes that helper over instead of starting another, so
// retries against a holder that makes no progress leave one helper, not one
// each.
int WaitInKernel(int fd, off_t offset, const Deadline& deadline,
                 std::shared_ptr<KernelWait>* left) {
  // Free already (its holder left before we came): no wait, no helper.
  if (const int err = OfdLock(fd, F_RDLCK, offset, /*wait=*/false);
      err != EACCES && err != EAGAIN) {
    return err;  // 0: granted on `fd` (the caller drops it)
  }
  // A wait that may not wait (a try-lock): no helper to leave behind.
  if (deadline.at.has_value() && MonoNow() >= *deadline.at) return ETIMEDOUT;
  std::shared_ptr<KernelWait> wait;
  if (*left != nullptr && (*left)->offset == offset) {
    wait = std::move(*left);  // still asleep for this byte, or granted since
  } else {
    wait = std::make_shared<KernelWait>();
    wait->offset = offset;
    const int err = StartHelper(fd, wait);
    if (err != 0) return err;
  }
  left->reset();
  const int err = AwaitHelper(*wait, deadline);
  if (err == ECANCELED || err == ETIMEDOUT) *left = std::move(wait);
  return err;
}

// Starts the helper thread of WaitInKernel on `wait`: 0, or -1 where it
// could not be made.
int StartHelper(int fd, const std::shared_ptr<KernelWait>& wait) {
  const off_t offset = wait->offset;
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  const int own = open(self.c_str(), O_RDWR | O_CLOEXEC);
  if (own < 0) return -1;
  struct stat a, b;
  if (fstat(fd, &a) != 0 || fstat(own, &b) != 0 || a.st_dev != b.st_dev ||
      a.st_ino != b.st_ino) {
    close(own);
    return -1;
  }
  absl::StatusOr<std::thread> helper =
      StartThread("a tier lock wait", [wait, own, offset] {
        const int err = OfdLock(own, F_RDLCK, offset, /*wait=*/true);
        // Dropped explicitly: a child forked meanwhile shares `own`'s open
        // file description, whose locks a close would leave to it.
        if (err == 0) OfdLock(own, F_UNLCK, offset, /*wait=*/false);
        close(own);
        MutexLock l(&wait->mu);
        wait->done = true;
        wait->err = err;
      });
  if (!helper.ok()) {
    close(own);
    return -1;
  }
  helper->detach();
  return 0;
}

// Waits for the helper's word: its errno (0: granted, and dropped), or
// ECANCELED / ETIMEDOUT first.
int AwaitHelper(KernelWait& wait, const Deadline& deadline) {
  MutexLock l(&wait.mu);
  for (;;) {
    MonoTime until = MonoAfter(kCancelCheck);
    if (deadline.at.has_value()) until = std::min(until, *deadline.at);
    if (wait.mu.AwaitWithDeadline(
            [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wait.mu) { return wait.done; },
            until)) {
      return wait.err;
    }
    if (deadline.cancel != nullptr && deadline.cancel->load()) return ECANCELED;
    if (deadline.at.has_value() && MonoNow() >= *deadline.at) return ETIMEDOUT;
  }
}

}  // namespace

struct TierLock::Impl {
  int fd = -1;
  std::string path;
  int max_holders = 1;
  bool held = false;
  int64_t ticket = -1;
  pid_t opener = 0;
  // The helper a wait that ended early left asleep (see WaitInKernel).
  std::shared_ptr<KernelWait> left_waiting;

  ~Impl() {
    if (fd < 0) return;
    // The last user (the write lock is granted only if no other TierLock
    // holds the presence byte) removes the file; closing the descriptor
    // drops the OFD's locks.
    if (getpid() == opener &&
        OfdLock(fd, F_WRLCK, kPresenceByte, /*wait=*/false) == 0) {
      unlink(path.c_str());
    }
    close(fd);
  }

  std::string Where(int64_t t) const {
    return absl::StrCat(path, " at offset ", kTicketBase + t);
  }

  off_t MarkOffset(int64_t t) const {
    return kMarkBase + 8 * (t % (int64_t{max_holders} * kMarkLanes));
  }

  // Records that ticket t entered (see the design note).
  absl::Status MarkEntered(int64_t t) {
    const int64_t mark = t + 1;  // a zeroed slot names no ticket
    if (pwrite(fd, &mark, sizeof(mark), MarkOffset(t)) != sizeof(mark)) {
      return ErrnoStatus(errno == 0 ? EIO : errno, "pwrite of an entered mark",
                         absl::StrCat(path, " at offset ", MarkOffset(t)));
    }
    return absl::OkStatus();
  }

  // Whether ticket t entered (false for one that died while waiting).
  absl::StatusOr<bool> Entered(int64_t t) const {
    int64_t mark = 0;
    const ssize_t n = pread(fd, &mark, sizeof(mark), MarkOffset(t));
    if (n < 0) {
      return ErrnoStatus(errno, "pread of an entered mark",
                         absl::StrCat(path, " at offset ", MarkOffset(t)));
    }
    return n == sizeof(mark) && mark == t + 1;
  }

  // DeadlineExceeded naming the lock, for a wait on `what` that outlasted
  // its deadline.
  absl::Status TimedOut(const Deadline& deadline,
                        absl::string_view what) const {
    return absl::DeadlineExceededError(absl::StrCat(
        "waited ", absl::FormatDuration(deadline.timeout),
        " for the tier lock ", path, " (", what,
        "): a process that shares the tier holds its turn without making "
        "progress (stopped, or hung in I/O); the lock is freed when it "
        "resumes or dies"));
  }

  // Cancelled naming the lock, for a wait on `what` whose cancel flag was
  // set.
  absl::Status Cancelled(absl::string_view what) const {
    return absl::CancelledError(absl::StrCat(
        "the wait for the tier lock ", path, " (", what, ") was interrupted"));
  }

  absl::StatusOr<int64_t> TakeTicket(const Deadline& deadline) {
    if (int err = OfdLockUntil(fd, F_WRLCK, 0, deadline); err != 0) {
      if (err == ETIMEDOUT) return TimedOut(deadline, "its ticket counter");
      if (err == ECANCELED) return Cancelled("its ticket counter");
      return ErrnoStatus(
          err, absl::StrCat(deadline.Call(), " on the ticket counter of"),
          absl::StrCat(path, " at offset 0"));
    }
    int64_t counter = 0;
    const ssize_t n = pread(fd, &counter, sizeof(counter), 0);
    if (n < 0) {
      const int err = errno;
      OfdLock(fd, F_UNLCK, 0, false);
      return ErrnoStatus(err, "pread of the ticket counter",
                         absl::StrCat(path, " at offset 0"));
    }
    if (n != sizeof(counter) || counter < 0) counter = 0;  // new file
    int64_t t = counter;
    // The ticket byte is normally free; it is taken only if the counter went
    // backwards (file truncated by hand), so skip over live tickets.
    int err;
    while ((err = OfdLock(fd, F_WRLCK, kTicketBase + t, false)) == EAGAIN ||
           err == EACCES) {
      ++t;
    }
    if (err != 0) {
      OfdLock(fd, F_UNLCK, 0, false);
      return ErrnoStatus(err, "fcntl(F_OFD_SETLK) of a ticket in", Where(t));
    }
    // Locked before the counter moves: dying here just leaves ticket t free
    // for the next process, which takes it again.
    const int64_t next = t + 1;
    if (pwrite(fd, &next, sizeof(next), 0) != sizeof(next)) {
      const int saved = errno;
      OfdLock(fd, F_UNLCK, kTicketBase + t, false);
      OfdLock(fd, F_UNLCK, 0, false);
      return ErrnoStatus(saved == 0 ? EIO : saved,
                         "pwrite of the ticket counter",
                         absl::StrCat(path, " at offset 0"));
    }
    OfdLock(fd, F_UNLCK, 0, false);
    return t;
  }
};

TierLock::TierLock(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TierLock::~TierLock() { Release(); }

absl::StatusOr<std::unique_ptr<TierLock>> TierLock::Open(
    const std::string& lock_path, int max_holders) {
  if (max_holders < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TierLock::Open ", lock_path,
                     ": max_holders must be >= 1, got ", max_holders));
  }
  auto impl = std::make_unique<Impl>();
  impl->path = lock_path + ".tickets";
  impl->max_holders = max_holders;
  impl->opener = getpid();
  for (;;) {
    int fd;
    do {
      fd = open(impl->path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW,
                0600);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return ErrnoStatus(errno, "open", impl->path);
    if (int err = OfdLock(fd, F_RDLCK, kPresenceByte, /*wait=*/true);
        err != 0) {
      close(fd);
      return ErrnoStatus(err, "fcntl(F_OFD_SETLKW) of the presence lock of",
                         impl->path);
    }
    struct stat opened, named;
    if (fstat(fd, &opened) != 0) {
      const int err = errno;
      close(fd);
      return ErrnoStatus(err, "fstat", impl->path);
    }
    if (lstat(impl->path.c_str(), &named) == 0 &&
        named.st_dev == opened.st_dev && named.st_ino == opened.st_ino) {
      impl->fd = fd;
      break;
    }
    // Removed by its last user between our open() and our lock: again.
    close(fd);
  }
  return std::unique_ptr<TierLock>(new TierLock(std::move(impl)));
}

absl::Status TierLock::Acquire(absl::Duration timeout,
                               const std::atomic<bool>* cancel) {
  if (impl_->held) {
    return absl::FailedPreconditionError(
        absl::StrCat("TierLock::Acquire on ", impl_->path,
                     ": already held by this object (not reentrant)"));
  }
  if (timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TierLock::Acquire on ", impl_->path,
                     ": negative timeout ", absl::FormatDuration(timeout)));
  }
  const Deadline deadline(timeout, cancel);
  MLP_ASSIGN_OR_RETURN(const int64_t t, impl_->TakeTicket(deadline));
  // Waits for the lane's earlier tickets back to one that entered (a ticket
  // that died waiting never did; the one it waited for may hold the lock).
  absl::Status status;
  for (int64_t p = t - impl_->max_holders; p >= 0 && status.ok();
       p -= impl_->max_holders) {
    const off_t byte = kTicketBase + p;
    int err = deadline.polls() ? WaitInKernel(impl_->fd, byte, deadline,
                                              &impl_->left_waiting)
                               : -1;
    const char* call = err >= 0 ? "fcntl(F_OFD_SETLKW)" : deadline.Call();
    if (err < 0) err = OfdLockUntil(impl_->fd, F_RDLCK, byte, deadline);
    if (err != 0) {
      // (Our own byte is released below: the tickets after ours see that
      // we never entered and wait for the one we waited for.)
      const std::string what = absl::StrCat("ticket ", t, " waiting for ", p);
      if (err == ETIMEDOUT) {
        status = impl_->TimedOut(deadline, what);
      } else if (err == ECANCELED) {
        status = impl_->Cancelled(what);
      } else {
        status =
            ErrnoStatus(err, absl::StrCat(call, " waiting for a ticket in"),
                        impl_->Where(p));
      }
      break;
    }
    OfdLock(impl_->fd, F_UNLCK, byte, false);  // (none held after a helper)
    absl::StatusOr<bool> entered = impl_->Entered(p);
    if (!entered.ok()) status = entered.status();
    if (!entered.ok() || *entered) break;
  }
  if (status.ok()) status = impl_->MarkEntered(t);
  if (!status.ok()) {
    OfdLock(impl_->fd, F_UNLCK, kTicketBase + t, false);
    return status;
  }
  impl_->ticket = t;
  impl_->held = true;
  return absl::OkStatus();
}

void TierLock::Release() {
  if (!impl_ || !impl_->held) return;
  // Unlocking a lock we hold cannot fail short of a bad descriptor; closing
  // the descriptor in ~Impl would release it in any case.
  OfdLock(impl_->fd, F_UNLCK, kTicketBase + impl_->ticket, false);
  impl_->held = false;
  impl_->ticket = -1;
}

bool TierLock::held() const { return impl_->held; }

bool TierLock::HasWaiters() const {
  if (!impl_ || !impl_->held) return false;
  int64_t counter = 0;
  if (pread(impl_->fd, &counter, sizeof(counter), 0) != sizeof(counter))
    return true;
  return counter > impl_->ticket + 1;
}

RunLock::RunLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}

absl::Status RunLock::CheckStillAtPath() const {
  return CheckOpenFileAtPath(fd_, path_, "the run's lock");
}

RunLock::~RunLock() {
  // Clear the pid so a later reader is not pointed at a finished process;
  // the file stays (see the TierLock note on unlinking lock files).
  if (ftruncate(fd_, 0) < 0) {
    // Nothing to do: the flock is dropped by close either way.
  }
  close(fd_);
}

absl::StatusOr<std::unique_ptr<RunLock>> RunLock::Acquire(
    const std::string& path) {
  int fd;
  do {
    fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoStatus(errno, "open", path);
  // flock belongs to the open file description: it is dropped when its holder
  // dies (so a dead run is taken over silently) and two RunLocks in one
  // process conflict like two processes.
  int rc;
  do {
    rc = flock(fd, LOCK_EX | LOCK_NB);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) {
      close(fd);
      return ErrnoStatus(err, "flock", path);
    }
    char text[32] = {};
    const ssize_t n = pread(fd, text, sizeof(text) - 1, 0);
    close(fd);
    int pid = 0;
    std::string holder = "pid unknown";
    if (n > 0 &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(text, n)),
                         &pid)) {
      holder = absl::StrCat("pid ", pid);
    }
    // Two RunLocks in one process conflict too (see above): a second
    // optimizer on the same run, not some other program.
    const bool ours = pid != 0 && pid == getpid();
    return absl::AlreadyExistsError(
        absl::StrCat("run lock ", path, " is held by another ",
                     ours ? "optimizer in this process" : "live process", " (",
                     holder, ")"));
  }
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) < 0 || pwrite(fd, pid.data(), pid.size(), 0) !=
                                  static_cast<ssize_t>(pid.size())) {
    const int err = errno;
    close(fd);
    return ErrnoStatus(err == 0 ? EIO : err, "writing the pid into", path);
  }
  return std::unique_ptr<RunLock>(new RunLock(fd, path));
}

}  // namespace mlp_offload
