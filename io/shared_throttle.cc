#include "io/shared_throttle.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "io/internal/paced_engine.h"
#include "io/internal/poll.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/status_macros.h"

namespace mlp_offload {
namespace {

constexpr uint64_t kMagic = 0x4d4c50546872746cull;  // "MLPThrtl"

// The file's contents, read and written whole under the file's lock (not
// mapped: a mapping of a file that someone truncates, or whose first write
// finds the disk full, kills the process with SIGBUS; a read or write returns
// an error instead). All zeros but the magic is the initial state: clocks in
// the past, nobody streaming.
struct Record {
  uint64_t magic = 0;
  // Per direction (IoOp), CLOCK_MONOTONIC ns at which the device is free.
  int64_t next_free_ns[2] = {0, 0};
  // Engines with I/O outstanding.
  int32_t streaming = 0;
  uint32_t unused = 0;
};
static_assert(sizeof(Record) == 32, "the state file's size");

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Holds flock(LOCK_EX) on a descriptor for its lifetime. flock locks belong
// to the open file description, so they exclude other engines (each opens the
// file itself) and other processes; threads of one engine are kept apart by
// the engine's mutex. A bounded wait polls (flock takes no deadline:
// PollWithBackoff).
class FileLock {
 public:
  static absl::StatusOr<FileLock> Take(int fd, const std::string& path,
                                       absl::Duration timeout) {
    if (timeout == absl::InfiniteDuration()) {
      while (flock(fd, LOCK_EX) != 0) {
        if (errno != EINTR) return ErrnoStatus(errno, "flock", path);
      }
      return FileLock(fd);
    }
    const int err = internal_io::PollWithBackoff(
        [fd] {
          while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            if (errno != EINTR) return errno;  // EWOULDBLOCK: EAGAIN
          }
          return 0;
        },
        MonoAfter(timeout), nullptr);
    if (err == ETIMEDOUT) {
      return absl::DeadlineExceededError(absl::StrCat(
          "waited ", absl::FormatDuration(timeout),
          " for the lock of the shared throttle state file ", path,
          ": a process that shares the device holds it without making "
          "progress (stopped, or hung in I/O)"));
    }
    if (err != 0) return ErrnoStatus(err, "flock", path);
    return FileLock(fd);
  }
  FileLock(FileLock&& other) : fd_(std::exchange(other.fd_, -1)) {}
  FileLock& operator=(FileLock&&) = delete;
  ~FileLock() {
    if (fd_ >= 0) flock(fd_, LOCK_UN);
  }

 private:
  explicit FileLock(int fd) : fd_(fd) {}
  int fd_;
};

absl::Status ReadRecord(int fd, const std::string& path, Record* record) {
  const ssize_t n = pread(fd, record, sizeof(Record), 0);
  if (n < 0) return ErrnoStatus(errno, "read", path);
  if (static_cast<size_t>(n) != sizeof(Record) || record->magic != kMagic) {
    return absl::UnavailableError(absl::StrCat(
        "shared throttle state file ", path,
        " was truncated or overwritten while in use (read ", n, " of ",
        sizeof(Record), " bytes", n > 0 ? ", or a wrong magic" : "", ")"));
  }
  return absl::OkStatus();
}

absl::Status WriteRecord(int fd, const std::string& path,
                         const Record& record) {
  const ssize_t n = pwrite(fd, &record, sizeof(Record), 0);
  if (n < 0) return ErrnoStatus(errno, "write", path);
  if (static_cast<size_t>(n) != sizeof(Record)) {
    return absl::UnavailableError(
        absl::StrCat("shared throttle state file ", path, ": short write (", n,
                     " of ", sizeof(Record), " bytes)"));
  }
  return absl::OkStatus();
}

// The device's clocks, in the shared file. Reserve is the local throttle's
// virtual scheduling done on the shared clock under the file's lock, each
// piece costing (1 + contention (k - 1)) times its size at the cap, k the
// engines streaming when it is reserved.
class SharedClock final : public internal_io::PaceClock {
 public:
  SharedClock(const SharedThrottleOptions& options, int fd)
      : rate_{options.read_bytes_per_sec, options.write_bytes_per_sec},
        contention_(options.contention),
        half_duplex_(options.half_duplex),
        lock_timeout_(options.lock_timeout),
        path_(options.state_path),
        fd_(fd) {}
  ~SharedClock() override {
    {
      ::mlp_offload::MutexLock lock(&mu_);
      if (owed_ > 0) (void)AddToStreamCount(0);  // a last try
    }
    close(fd_);
  }

  bool Capped(IoOp op) const override {
    return rate_[static_cast<int>(op)] > 0;
  }

  absl::StatusOr<MonoTime> Reserve(IoOp op, size_t bytes) override {
    const int o = static_cast<int>(op);
    ::mlp_offload::MutexLock lock(&mu_);
    // A failed stream count is reported by the next piece (once).
    MLP_RETURN_IF_ERROR(std::exchange(count_error_, absl::OkStatus()));
    MLP_ASSIGN_OR_RETURN(FileLock file_lock,
                         FileLock::Take(fd_, path_, lock_timeout_));
    Record record;
    MLP_RETURN_IF_ERROR(ReadRecord(fd_, path_, &record));
    const double factor =
        1.0 + contention_ * (std::max(1, record.streaming) - 1);
    const int64_t cost_ns = static_cast<int64_t>(static_cast<double>(bytes) *
                                                 factor / rate_[o] * 1e9);
    const int64_t now = MonotonicNs();
    const int clock = half_duplex_ ? 0 : o;  // half duplex: one clock for both
    const int64_t start = std::max(record.next_free_ns[clock], now);
    record.next_free_ns[clock] = start + cost_ns;
    record.streaming = std::max(0, record.streaming - owed_);
    MLP_RETURN_IF_ERROR(WriteRecord(fd_, path_, record));
    owed_ = 0;
    return MonoNow() + std::chrono::duration_cast<MonoClock::duration>(
                           std::chrono::nanoseconds(start - now));
  }

  // The count of streaming engines in the file. A start that could not be
  // counted is not taken back at the stop; a count never goes below zero (a
  // file claimed afresh while this engine streamed). A stop that could not
  // be counted (the file's lock not granted in time) is owed: the next
  // section under the lock takes it off, as does the destructor.
  void StreamStarts() override {
    ::mlp_offload::MutexLock lock(&mu_);
    const absl::Status s = AddToStreamCount(+1);
    counted_ = s.ok();
    if (!s.ok() && count_error_.ok()) count_error_ = s;
  }
  void StreamStops() override {
    ::mlp_offload::MutexLock lock(&mu_);
    if (!counted_) return;
    counted_ = false;
    if (!AddToStreamCount(-1).ok()) ++owed_;
  }

 private:
  absl::Status AddToStreamCount(int delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    MLP_ASSIGN_OR_RETURN(FileLock file_lock,
                         FileLock::Take(fd_, path_, lock_timeout_));
    Record record;
    MLP_RETURN_IF_ERROR(ReadRecord(fd_, path_, &record));
    record.streaming = std::max(0, record.streaming + delta - owed_);
    MLP_RETURN_IF_ERROR(WriteRecord(fd_, path_, record));
    owed_ = 0;
    return absl::OkStatus();
  }

  const double rate_[2];
  const double contention_;
  const bool half_duplex_;
  const absl::Duration lock_timeout_;
  const std::string path_;
  const int fd_;
  ::mlp_offload::Mutex mu_;
  absl::Status count_error_ ABSL_GUARDED_BY(mu_);
  bool counted_ ABSL_GUARDED_BY(mu_) = false;
  int owed_ ABSL_GUARDED_BY(mu_) = 0;  // stops not yet counted in the file
};

// Under the file's lock: an empty file becomes a state file (its record
// written, so a full disk is an error here, not later); a state file is
// joined. Anything else is somebody else's file.
absl::Status ClaimStateFile(int fd, const std::string& path,
                            absl::Duration lock_timeout) {
  MLP_ASSIGN_OR_RETURN(FileLock file_lock,
                       FileLock::Take(fd, path, lock_timeout));
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a shared throttle state file (not a regular file)"));
  }
  Record fresh;
  fresh.magic = kMagic;
  if (st.st_size == 0) {
    const absl::Status written = WriteRecord(fd, path, fresh);
    // Part of a record would make the file nobody's: empty, the next
    // opener claims it.
    if (!written.ok()) (void)ftruncate(fd, 0);
    return written;
  }
  Record record;
  const ssize_t n =
      st.st_size == sizeof(Record) ? pread(fd, &record, sizeof(Record), 0) : 0;
  if (n < 0) return ErrnoStatus(errno, "read", path);
  if (static_cast<size_t>(n) == sizeof(Record)) {
    if (record.magic == kMagic) return absl::OkStatus();
    // All zeros: an earlier version's file, extended but not yet claimed.
    static const Record kZeros;
    if (std::memcmp(&record, &kZeros, sizeof(Record)) == 0) {
      return WriteRecord(fd, path, fresh);
    }
  }
  return absl::FailedPreconditionError(
      absl::StrCat(path, " is not a shared throttle state file (",
                   static_cast<int64_t>(st.st_size), " bytes)"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<IoEngine>> MakeSharedThrottledEngine(
    std::unique_ptr<IoEngine> inner, const SharedThrottleOptions& options) {
  if (!(options.contention >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared throttle ", options.state_path,
                     ": contention must be >= 0, got ", options.contention));
  }
  if (!(options.lock_timeout > absl::ZeroDuration())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared throttle ", options.state_path,
                     ": lock_timeout must be > 0, got ",
                     absl::FormatDuration(options.lock_timeout)));
  }
  const int fd = open(options.state_path.c_str(),
                      O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, "open", options.state_path);
  const absl::Status claimed =
      ClaimStateFile(fd, options.state_path, options.lock_timeout);
  if (!claimed.ok()) {
    close(fd);
    return claimed;
  }
  return internal_io::MakePacedEngine(
      std::move(inner), std::make_unique<SharedClock>(options, fd),
      "shared_throttle");
}

}  // namespace mlp_offload
