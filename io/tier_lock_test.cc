#include "io/tier_lock.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "io/internal/test_util.h"
#include "mlp_offload/base/clock.h"

namespace mlp_offload {
namespace {

using internal_io::ScratchPath;

// Counters shared by the forked processes.
struct Shared {
  std::atomic<int> inside{0};
  std::atomic<int> max_inside{0};
  std::atomic<int> errors{0};
};

Shared* MapShared() {
  void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return new (p) Shared;
}

// Runs `body` in a child process that exits 0 if it returns true.
template <typename F>
pid_t Spawn(F body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body() ? 0 : 1);
  return pid;
}

bool WaitOk(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

// Write-locks byte `offset` of `fd`'s file through its open file
// description (as another TierLock's would be), without waiting.
bool WriteLockByte(int fd, off_t offset) {
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = offset;
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

// Reads one byte from `fd` within `ms`; -1 when nothing came.
int ReadByte(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, ms) != 1) return -1;
  char c;
  return read(fd, &c, 1) == 1 ? c : -1;
}

void Contend(const std::string& path, int max_holders, Shared* shared) {
  std::vector<pid_t> children;
  for (int i = 0; i < 4; ++i) {
    children.push_back(Spawn([&] {
      absl::StatusOr<std::unique_ptr<TierLock>> lock =
          TierLock::Open(path, max_holders);
      if (!lock.ok()) return false;
      for (int iter = 0; iter < 25; ++iter) {
        if (!(*lock)->Acquire().ok()) return false;
        const int now = shared->inside.fetch_add(1) + 1;
        int seen = shared->max_inside.load();
        while (now > seen &&
               !shared->max_inside.compare_exchange_weak(seen, now)) {
        }
        usleep(2000);  // hold it long enough for the others to pile up
        shared->inside.fetch_sub(1);
        (*lock)->Release();
      }
      return true;
    }));
  }
  for (pid_t pid : children) EXPECT_TRUE(WaitOk(pid));
}

TEST(TierLockTest, FourProcessesMutuallyExclusive) {
  Shared* shared = MapShared();
  Contend(ScratchPath("tier1"), 1, shared);
  EXPECT_EQ(shared->max_inside.load(), 1);
}

TEST(TierLockTest, TwoHoldersAllowsExactlyTwo) {
  Shared* shared = MapShared();
  Contend(ScratchPath("tier2"), 2, shared);
  EXPECT_EQ(shared->max_inside.load(), 2);
}

TEST(TierLockTest, ThirdWaitsWhileTwoHoldThenEnters) {
  const std::string path = ScratchPath("tier_k2");
  // Two objects in this process are two holders.
  auto a = *TierLock::Open(path, 2);
  auto b = *TierLock::Open(path, 2);
  ASSERT_TRUE(a->Acquire().ok());
  ASSERT_TRUE(b->Acquire().ok());
  EXPECT_EQ(a->Acquire().code(),
            absl::StatusCode::kFailedPrecondition);  // not reentrant
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = Spawn([&] {
    auto c = *TierLock::Open(path, 2);
    if (!c->Acquire().ok()) return false;
    return write(fds[1], "c", 1) == 1;
  });
  EXPECT_EQ(ReadByte(fds[0], 300), -1) << "a third holder got in with K=2";
  a->Release();
  EXPECT_FALSE(a->held());
  EXPECT_EQ(ReadByte(fds[0], 30000), 'c');
  EXPECT_TRUE(WaitOk(child));
}

TEST(TierLockTest, RecoversAfterHolderIsKilled) {
  const std::string path = ScratchPath("tier_kill");
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t holder = Spawn([&] {
    auto lock = *TierLock::Open(path, 1);
    if (!lock->Acquire().ok() || write(fds[1], "a", 1) != 1) return false;
    for (;;) pause();
  });
  ASSERT_EQ(ReadByte(fds[0], 30000), 'a');
  const pid_t waiter = Spawn([&] {
    auto lock = *TierLock::Open(path, 1);
    if (!lock->Acquire().ok()) return false;
    return write(fds[1], "b", 1) == 1;
  });
  EXPECT_EQ(ReadByte(fds[0], 300), -1)
      << "waiter entered while the holder lived";
  ASSERT_EQ(kill(holder, SIGKILL), 0);
  int status;
  ASSERT_EQ(waitpid(holder, &status, 0), holder);
  EXPECT_EQ(ReadByte(fds[0], 30000), 'b');
  EXPECT_TRUE(WaitOk(waiter));
}

// The ticket counter stored at the start of the lock file.
int64_t Tickets(const std::string& path) {
  const int fd = open((path + ".tickets").c_str(), O_RDONLY);
  int64_t v = 0;
  if (fd >= 0) {
    if (pread(fd, &v, sizeof(v), 0) != sizeof(v)) v = 0;
    close(fd);
  }
  return v;
}

TEST(TierLockTest, WaitersEnterInArrivalOrder) {
  const std::string path = ScratchPath("tier_fifo");
  auto mine = *TierLock::Open(path, 1);
  ASSERT_TRUE(mine->Acquire().ok());
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  std::vector<pid_t> children;
  for (char id : {'1', '2', '3'}) {
    const int64_t before = Tickets(path);
    children.push_back(Spawn([&, id] {
      auto lock = *TierLock::Open(path, 1);
      if (!lock->Acquire().ok()) return false;
      usleep(1000);
      return write(fds[1], &id, 1) == 1;
    }));
    // Arrival = taking a ticket; wait for it before starting the next one.
    for (int i = 0; i < 30000 && Tickets(path) == before; ++i) usleep(1000);
    ASSERT_EQ(Tickets(path), before + 1);
  }
  mine->Release();
  EXPECT_EQ(ReadByte(fds[0], 30000), '1');
  EXPECT_EQ(ReadByte(fds[0], 30000), '2');
  EXPECT_EQ(ReadByte(fds[0], 30000), '3');
  for (pid_t pid : children) EXPECT_TRUE(WaitOk(pid));
}

// A waiter killed while it waits releases its ticket without having entered:
// the next ticket of its lane still waits for the holder that one waited for
// (with K=2, a lane is every other ticket).
TEST(TierLockTest, AWaiterKilledWhileWaitingLetsNobodyPastTheHolder) {
  for (int k : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("K=", k));
    const std::string path = ScratchPath(absl::StrCat("tier_dead_waiter", k));
    std::vector<std::unique_ptr<TierLock>> holders;
    for (int i = 0; i < k; ++i) {
      holders.push_back(*TierLock::Open(path, k));
      ASSERT_TRUE(holders.back()->Acquire().ok());
    }
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    std::vector<pid_t> waiters;
    for (int i = 0; i < 2 * k; ++i) {  // tickets k..3k-1: two per lane
      const int64_t before = Tickets(path);
      waiters.push_back(Spawn([&] {
        auto lock = *TierLock::Open(path, k);
        if (!lock->Acquire().ok()) return false;
        return write(fds[1], "w", 1) == 1;
      }));
      for (int j = 0; j < 30000 && Tickets(path) == before; ++j) usleep(1000);
      ASSERT_EQ(Tickets(path), before + 1);
    }
    // The first waiter of each lane dies while it waits.
    for (int i = 0; i < k; ++i) {
      ASSERT_EQ(kill(waiters[i], SIGKILL), 0);
      int status;
      ASSERT_EQ(waitpid(waiters[i], &status, 0), waiters[i]);
    }
    EXPECT_EQ(ReadByte(fds[0], 300), -1)
        << "a waiter entered while " << k << " holders held the lock";
    for (auto& h : holders) h->Release();
    for (int i = 0; i < k; ++i) EXPECT_EQ(ReadByte(fds[0], 30000), 'w');
    for (int i = k; i < 2 * k; ++i) EXPECT_TRUE(WaitOk(waiters[i]));
    close(fds[0]);
    close(fds[1]);
  }
}

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

TEST(TierLockTest, TheLastUserRemovesTheFile) {
  const std::string path = ScratchPath("tier_last");
  const std::string file = path + ".tickets";
  auto a = *TierLock::Open(path, 1);
  auto b = *TierLock::Open(path, 1);
  ASSERT_TRUE(a->Acquire().ok());
  a->Release();
  ASSERT_TRUE(Exists(file));
  a.reset();
  EXPECT_TRUE(Exists(file)) << "removed while another TierLock had it open";
  ASSERT_TRUE(b->Acquire().ok());
  b.reset();  // held: released, then removed
  EXPECT_FALSE(Exists(file));
  // A new user starts a new file, and a new queue.
  auto c = *TierLock::Open(path, 1);
  EXPECT_TRUE(Exists(file));
  EXPECT_TRUE(c->Acquire().ok());
}

TEST(TierLockTest, OpeningWhileTheFileIsRemovedOpensTheNewOne) {
  const std::string path = ScratchPath("tier_race");
  const std::string file = path + ".tickets";
  // Play a last user in the middle of its removal: the file exists and its
  // presence byte is write-locked.
  const int remover = open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(remover, 0);
  ASSERT_TRUE(WriteLockByte(remover, 1));
  std::atomic<bool> opened{false};
  absl::StatusOr<std::unique_ptr<TierLock>> lock;
  std::thread opener([&] {
    lock = TierLock::Open(path, 1);
    opened = true;
  });
  usleep(200 * 1000);
  EXPECT_FALSE(opened) << "opened past a removal in progress";
  ASSERT_EQ(unlink(file.c_str()), 0);
  close(remover);
  opener.join();
  ASSERT_TRUE(lock.ok()) << lock.status();
  // A new file (its inode number may be the freed old one's), and it is the
  // file the lock uses: another user's ticket waits for this one.
  EXPECT_TRUE(Exists(file));
  ASSERT_TRUE((*lock)->Acquire().ok());
  auto other = *TierLock::Open(path, 1);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t waiter = Spawn([&] {
    if (!other->Acquire().ok()) return false;
    return write(fds[1], "w", 1) == 1;
  });
  EXPECT_EQ(ReadByte(fds[0], 300), -1) << "two holders: the queue split";
  (*lock)->Release();
  EXPECT_EQ(ReadByte(fds[0], 30000), 'w');
  EXPECT_TRUE(WaitOk(waiter));
}

TEST(TierLockTest, AForkedChildDoesNotRemoveItsParentsFile) {
  const std::string path = ScratchPath("tier_fork");
  auto lock = *TierLock::Open(path, 1);
  const std::string file = path + ".tickets";
  const pid_t child = Spawn([&] {
    lock.reset();  // the child's copy of the parent's open file description
    return Exists(file);
  });
  EXPECT_TRUE(WaitOk(child));
  EXPECT_TRUE(Exists(file));
  EXPECT_TRUE(lock->Acquire().ok());
}

// A wait given a cancel flag ends soon after the flag is set, bounded or
// not, with Cancelled naming the lock, and holds nobody up after it.
// How many blocked (waiting) OFD lock requests /proc/locks lists on byte
// `offset` of the file `path`.
int KernelWaiters(const std::string& path, off_t offset) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return 0;
  const std::string tail =
      absl::StrCat(":", st.st_ino, " ", offset, " ", offset);
  FILE* f = fopen("/proc/locks", "r");
  if (f == nullptr) return 0;
  char line[512];
  int found = 0;
  while (fgets(line, sizeof(line), f) != nullptr) {
    const std::string text(line);
    if (text.find("-> OFDLCK") != std::string::npos &&
        text.find(tail) != std::string::npos) {
      ++found;
    }
  }
  fclose(f);
  return found;
}

// The blocked requests for ticket 0's byte (offset 4096 of the tickets
// file) of the lock at `path`: the waits of ticket 1 (with K = 1).
int WaitersForTicket0(const std::string& path) {
  return KernelWaiters(path + ".tickets", 4096);
}

// Two holders of the lock `name` (two objects of this process), the first
// holding it.
struct OneHolds {
  std::string path;
  std::unique_ptr<TierLock> holder, other;
};

OneHolds OneHoldsTheLock(const std::string& name) {
  OneHolds out{ScratchPath(name), nullptr, nullptr};
  out.holder = *TierLock::Open(out.path);
  out.other = *TierLock::Open(out.path);
  EXPECT_TRUE(out.holder->Acquire().ok());
  return out;
}

TEST(TierLockTest, AWaitEndsWhenItsCancelFlagIsSet) {
  OneHolds lock = OneHoldsTheLock("tier_cancel");
  for (const absl::Duration timeout :
       {absl::InfiniteDuration(), absl::Seconds(60)}) {
    std::atomic<bool> cancel{false};
    std::thread canceller([&] {
      absl::SleepFor(absl::Milliseconds(100));
      cancel = true;
    });
    const MonoTime start = MonoNow();
    const absl::Status s = lock.other->Acquire(timeout, &cancel);
    const double waited = SecondsSince(start);
    canceller.join();
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_NE(s.message().find(lock.path + ".tickets"), std::string::npos) << s;
    EXPECT_GE(waited, 0.09);
    EXPECT_LT(waited, 5.0);
    EXPECT_FALSE(lock.other->held());
  }
  lock.holder->Release();
  std::atomic<bool> cancel{false};
  EXPECT_TRUE(lock.other->Acquire(absl::Seconds(5), &cancel).ok());
  lock.other->Release();
}

// A wait with a cancel flag or a deadline sleeps in the kernel's lock queue
// like an unbounded one (no polling with pauses, which would hand a freed
// turn over up to 2 ms late), and still ends on its flag or deadline.
TEST(TierLockTest, ABoundedOrCancellableWaitSleepsInTheKernel) {
  OneHolds lock = OneHoldsTheLock("tier_kernel_wait");
  std::atomic<bool> cancel{false};
  std::atomic<bool> entered{false};
  std::thread waiter([&] {
    if (lock.other->Acquire(absl::Seconds(60), &cancel).ok()) entered = true;
  });
  bool waiting = false;
  for (int i = 0; i < 200 && !waiting; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    waiting = WaitersForTicket0(lock.path) > 0;
  }
  EXPECT_TRUE(waiting) << "no blocked lock request in /proc/locks";
  EXPECT_FALSE(entered.load());
  lock.holder->Release();
  waiter.join();
  EXPECT_TRUE(entered.load());
  lock.other->Release();
}

// Waits that time out against a holder that makes no progress, retried,
// leave one helper asleep for it, not one each; the next wait after the
// holder left takes the turn.
TEST(TierLockTest, RetriedWaitsLeaveOneHelperBehind) {
  OneHolds lock = OneHoldsTheLock("tier_retries");
  std::atomic<bool> cancel{false};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(lock.other->Acquire(absl::Milliseconds(30), &cancel).code(),
              absl::StatusCode::kDeadlineExceeded);
  }
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(WaitersForTicket0(lock.path), 1);
  lock.holder->Release();
  EXPECT_TRUE(lock.other->Acquire(absl::Seconds(10), &cancel).ok());
  lock.other->Release();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(WaitersForTicket0(lock.path), 0);
}

// A wait that may not wait (a zero timeout: a try-lock) leaves nothing
// waiting behind it.
TEST(TierLockTest, ATryLockLeavesNoWaiterBehind) {
  OneHolds lock = OneHoldsTheLock("tier_try");
  std::atomic<bool> cancel{false};
  EXPECT_EQ(lock.other->Acquire(absl::ZeroDuration(), &cancel).code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(WaitersForTicket0(lock.path), 0);
  lock.holder->Release();
  EXPECT_TRUE(lock.other->Acquire(absl::ZeroDuration(), &cancel).ok());
  lock.other->Release();
}

// A holder that is alive but makes no progress (a stopped process) never
// frees its byte: a bounded Acquire gives up, naming the lock, and leaves
// no trace that holds up the tickets after it.
TEST(TierLockTest, AWaitPastItsTimeoutFailsAndHoldsNobodyUp) {
  const std::string path = ScratchPath("tier_timeout");
  auto a = *TierLock::Open(path);
  auto b = *TierLock::Open(path);
  auto c = *TierLock::Open(path);
  ASSERT_TRUE(a->Acquire().ok());
  const MonoTime start = MonoNow();
  absl::Status s = b->Acquire(absl::Milliseconds(200));
  const absl::Duration waited = ToAbslDuration(MonoNow() - start);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find(path + ".tickets"), std::string::npos) << s;
  EXPECT_NE(s.message().find("ticket 1 waiting for 0"), std::string::npos) << s;
  EXPECT_GE(waited, absl::Milliseconds(200));
  EXPECT_LT(waited, absl::Seconds(10));
  EXPECT_FALSE(b->held());
  // c waits behind b's abandoned ticket, and so behind a: it enters once a
  // leaves, not before.
  std::atomic<bool> entered{false};
  std::thread waiter([&] {
    if (c->Acquire(absl::Seconds(60)).ok()) entered = true;
  });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(entered.load()) << "c got in while a held the lock";
  a->Release();
  waiter.join();
  EXPECT_TRUE(entered.load());
  c->Release();
  // b can try again.
  EXPECT_TRUE(b->Acquire(absl::Milliseconds(200)).ok());
  b->Release();
  EXPECT_EQ(b->Acquire(absl::Seconds(-1)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TierLockTest, AWaitForTheTicketCounterIsBoundedToo) {
  const std::string path = ScratchPath("tier_counter");
  auto a = *TierLock::Open(path);
  // Another open file description holds the counter's byte (a process
  // stopped while it took a ticket).
  const int fd = open((path + ".tickets").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(WriteLockByte(fd, 0));
  absl::Status s = a->Acquire(absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("its ticket counter"), std::string::npos) << s;
  close(fd);
  EXPECT_TRUE(a->Acquire(absl::Milliseconds(1000)).ok());
}

TEST(TierLockTest, RejectsZeroHolders) {
  EXPECT_EQ(TierLock::Open(ScratchPath("tier0"), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RunLockTest, SecondRunIsRefusedNamingPathAndPid) {
  const std::string path = ScratchPath("run.lock");
  absl::StatusOr<std::unique_ptr<RunLock>> first = RunLock::Acquire(path);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<RunLock>> second = RunLock::Acquire(path);
  ASSERT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(second.status().message().find(path), std::string::npos);
  EXPECT_NE(second.status().message().find(absl::StrCat("pid ", getpid())),
            std::string::npos)
      << second.status();
  first->reset();
  EXPECT_TRUE(RunLock::Acquire(path).ok());
}

TEST(RunLockTest, DeadHolderIsTakenOver) {
  const std::string path = ScratchPath("run_dead.lock");
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t holder = Spawn([&] {
    auto lock = RunLock::Acquire(path);
    if (!lock.ok() || write(fds[1], "a", 1) != 1) return false;
    for (;;) pause();
  });
  ASSERT_EQ(ReadByte(fds[0], 30000), 'a');
  EXPECT_EQ(RunLock::Acquire(path).status().code(),
            absl::StatusCode::kAlreadyExists);
  kill(holder, SIGKILL);
  int status;
  waitpid(holder, &status, 0);
  EXPECT_TRUE(RunLock::Acquire(path).ok());
}

}  // namespace
}  // namespace mlp_offload
