// The offload engine: tiers, buffers and the pipelined update phase.
//
// Memory: every host byte the engine uses is one of `num_cached +
// num_buffers` equal buffers, allocated once at Create (the plan sizes them
// within the budget), so the budget cannot be exceeded by construction; the
// high-water mark of buffers in use is still measured and reported.
//
// A buffer is [4 KiB header | record | fp32 gradient (baseline only)]: one
// aligned read brings a slot's header and payload, one write stores both.
//
// Threads: Step runs on the caller's thread; I/O completions arrive on the
// tiers' engine threads and only touch buffer bookkeeping under mu_; the
// kernels run on a ThreadPool owned by the engine.
#include "mlp_offload/engine.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "io/aligned_buffer.h"
#include "io/file.h"
#include "io/shared_throttle.h"
#include "io/tier_lock.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/status_macros.h"
#include "mlp_offload/base/thread_pool.h"
#include "mlp_offload/base/threads.h"
#include "mlp_offload/state_store.h"

namespace mlp_offload {
namespace {

constexpr uint64_t kAlign = kDirectIoAlignment;
// Written on every tier once a commit has reached every tier
// (recovery.has_committed_state reads it).
constexpr char kCommittedMark[] = "COMMITTED";
uint64_t RoundUp(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// 64-bit FNV-1a: a name that is the same in every process and build.
uint64_t StableHash(absl::string_view s) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Takes a cross-process tier lock around each burst of requests (technique
// 4): a dispatcher thread holds the lock while it has requests to issue and
// gives it up when its queue runs dry or its turn (kTurnBytes) is used up and
// another process waits, so the processes sharing the tier take turns instead
// of thrashing it.
class LockedDispatcher {
 public:
  LockedDispatcher(IoEngine* engine, std::unique_ptr<TierLock> lock,
                   absl::Duration timeout)
      : engine_(engine), lock_(std::move(lock)), timeout_(timeout) {
    absl::StatusOr<std::thread> t =
        StartThread("a tier lock's dispatcher", [this] { Dispatch(); });
    if (t.ok()) {
      dispatcher_ = *std::move(t);
    } else {
      start_status_ = t.status();  // the engine is refused: nothing queued
    }
  }
  ~LockedDispatcher() {  // issues what is queued first
    {
      MutexLock l(&mu_);
      stop_ = true;
    }
    if (dispatcher_.joinable()) dispatcher_.join();
  }

  const absl::Status& start_status() const { return start_status_; }

  void Submit(const IoRequest& request, IoCallback done) {
    MutexLock l(&mu_);
    queue_.push_back({request, std::move(done)});
  }

  // While interrupted, a wait for the lock ends at once with Cancelled (the
  // requests of that turn fail with it).
  void SetInterrupted(bool interrupted) { interrupted_.store(interrupted); }

 private:
  static constexpr uint64_t kTurnBytes = 256ull << 20;
  struct Pending {
    IoRequest request;
    IoCallback done;
  };

  void Dispatch() {
    for (;;) {
      {
        MutexLock l(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || !queue_.empty();
        };
        mu_.Await(ready);
        if (queue_.empty() && stop_) return;
      }
      // A wait past the timeout fails this turn's requests (the step
      // fails, naming the lock, and may be retried).
      absl::Status locked = lock_->Acquire(timeout_, &interrupted_);
      uint64_t turn = 0;
      for (;;) {
        std::deque<Pending> batch;
        {
          MutexLock l(&mu_);
          auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return !queue_.empty() || in_flight_ == 0;
          };
          mu_.Await(ready);
          if (!queue_.empty() && turn >= kTurnBytes && !lock_->HasWaiters()) {
            turn = 0;  // nobody else wants the tier: keep it
          }
          if (queue_.empty() || turn >= kTurnBytes) {
            // Drained (nothing in flight either) or the turn is over: let
            // another process have the tier.
            auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
              return in_flight_ == 0;
            };
            mu_.Await(idle);
            break;
          }
          batch.swap(queue_);
          in_flight_ += batch.size();
        }
        for (Pending& p : batch) {
          turn += p.request.length;
          if (!locked.ok()) {
            p.done(Annotate(locked, "tier lock"));
            Finished();
            continue;
          }
          IoCallback done = std::move(p.done);
          engine_->Submit(p.request, [this, done = std::move(done)](
                                         absl::StatusOr<size_t> r) {
            done(std::move(r));
            Finished();
          });
        }
        // A failed wait fails the requests queued while it lasted, not the
        // ones queued after it (a retried step's): they wait afresh.
        if (!locked.ok()) break;
      }
      if (locked.ok()) lock_->Release();
    }
  }

  void Finished() {
    MutexLock l(&mu_);
    --in_flight_;
  }

  IoEngine* const engine_;
  std::unique_ptr<TierLock> lock_;
  const absl::Duration timeout_;
  std::atomic<bool> interrupted_{false};
  absl::Status start_status_;  // fixed after construction
  std::thread dispatcher_;
  Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  size_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

// Sends a tier's requests through its engine: directly (no tier lock), under
// one lock for all of them, or under one lock for reads and another for
// writes (TierLockMode::kPerDirection).
// The tier channel whose Submit is running on this thread (see TierChannel).
thread_local const void* tls_submitting_channel = nullptr;

class TierChannel {
 public:
  // `locks`: none, one for every request, or {reads' lock, writes' lock}.
  TierChannel(std::unique_ptr<IoEngine> engine,
              std::vector<std::unique_ptr<TierLock>> locks,
              absl::Duration lock_timeout)
      : engine_(std::move(engine)) {
    for (auto& lock : locks) {
      dispatchers_.push_back(std::make_unique<LockedDispatcher>(
          engine_.get(), std::move(lock), lock_timeout));
      if (start_status_.ok())
        start_status_ = dispatchers_.back()->start_status();
    }
    // Started now, not at its first use: a completion then has nowhere else
    // to go.
    absl::StatusOr<std::thread> t =
        StartThread("a tier's completion deferrer", [this] { Deliver(); });
    MutexLock l(&mu_);
    if (t.ok()) {
      deferrer_ = *std::move(t);
    } else if (start_status_.ok()) {
      start_status_ = t.status();
    }
  }

  // Whether every thread started; the engine refuses the channel otherwise.
  const absl::Status& start_status() const { return start_status_; }
  ~TierChannel() {
    dispatchers_.clear();  // issues what they still hold
    engine_->Shutdown();
    std::thread deferrer;
    {
      MutexLock l(&mu_);
      stop_ = true;
      deferrer = std::move(deferrer_);
    }
    if (deferrer.joinable()) deferrer.join();  // delivers what is queued
  }

  IoEngine* engine() const { return engine_.get(); }

  // Engine::SetInterrupted: the waits for the tier lock and the requests
  // the engine holds back.
  void SetInterrupted(bool interrupted) {
    for (auto& d : dispatchers_) d->SetInterrupted(interrupted);
    engine_->SetInterrupted(interrupted);
  }

  // The engine submits with its mutex held and its completions take that
  // mutex, so a completion must never run inside Submit. Engines may
  // complete a request on the submitting thread (an error found before
  // any I/O, a ring that broke, an engine shutting down, an injected
  // fault): such completions are handed to a thread of this channel.
  void Submit(const IoRequest& request, IoCallback done) {
    if (!dispatchers_.empty()) {  // completions come on other threads
      const size_t d =
          dispatchers_.size() == 2 && request.op == IoOp::kWrite ? 1 : 0;
      dispatchers_[d]->Submit(request, std::move(done));
      return;
    }
    const void* outer = tls_submitting_channel;
    tls_submitting_channel = this;
    engine_->Submit(request, [this, done = std::move(done)](
                                 absl::StatusOr<size_t> r) mutable {
      if (tls_submitting_channel == this) {
        Defer(std::move(done), std::move(r));
      } else {
        done(std::move(r));
      }
    });
    tls_submitting_channel = outer;
  }

 private:
  void Defer(IoCallback done, absl::StatusOr<size_t> r) {
    MutexLock l(&mu_);
    deferred_.push_back({std::move(done), std::move(r)});
  }

  void Deliver() {
    for (;;) {
      std::deque<std::pair<IoCallback, absl::StatusOr<size_t>>> batch;
      {
        MutexLock l(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || !deferred_.empty();
        };
        mu_.Await(ready);
        if (deferred_.empty()) return;  // stopped, all delivered
        batch.swap(deferred_);
      }
      for (auto& [done, r] : batch) done(std::move(r));
    }
  }

  std::unique_ptr<IoEngine> engine_;
  std::vector<std::unique_ptr<LockedDispatcher>> dispatchers_;
  absl::Status start_status_;  // fixed after construction
  Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::pair<IoCallback, absl::StatusOr<size_t>>> deferred_
      ABSL_GUARDED_BY(mu_);
  std::thread deferrer_ ABSL_GUARDED_BY(mu_);
};

enum class BufState { kFree, kReading, kReady, kInUse, kWriting, kCached };

struct Buffer {
  AlignedBuffer mem;
  int subgroup = -1;
  BufState state = BufState::kFree;
  int pending = 0;              // I/O requests in flight on this buffer
  absl::Status io_status;       // first error of those requests
  bool from_disk = false;       // payload must be verified before use
  int write_slot = -1;          // slot being written
  uint64_t write_checksum = 0;  // that record's payload checksum
  bool grad_write = false;      // the baseline's gradient write is in flight
  int grad_subgroup = -1;       // whose gradient that is
  bool scratch = false;         // claimed for that write only: free when done
};

// The MANIFEST of the run in `dirs` (one directory per tier, in order):
// every tier's, checked against `expected` (state arrays and subgroup
// sizes) and against tier 0's (one run, one placement, on tiers that are
// configured). `texts` gets each tier's bytes.
absl::StatusOr<Manifest> ReadRunManifest(const std::vector<std::string>& dirs,
                                         const Manifest& expected,
                                         std::vector<std::string>* texts) {
  Manifest first;
  texts->clear();
  for (size_t t = 0; t < dirs.size(); ++t) {
    std::string mpath = dirs[t] + "/MANIFEST";
    MLP_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(mpath));
    MLP_ASSIGN_OR_RETURN(Manifest m, ParseManifest(text, mpath));
    MLP_RETURN_IF_ERROR(CheckManifestMatches(expected, m, mpath));
    texts->push_back(std::move(text));
    if (t == 0) {
      for (size_t i = 0; i < m.tier_of_subgroup.size(); ++i) {
        const int k = m.tier_of_subgroup[i];
        if (k < 0 || k >= static_cast<int>(dirs.size())) {
          return absl::FailedPreconditionError(
              absl::StrCat(mpath, " places subgroup ", i, " on tier ", k,
                           ", but ", dirs.size(),
                           " tiers are configured: give the tiers the run "
                           "used, in its order"));
        }
      }
      first = std::move(m);
    } else if (m.run_id != first.run_id ||
               m.tier_of_subgroup != first.tier_of_subgroup) {
      return absl::FailedPreconditionError(absl::StrCat(
          mpath, " belongs to another run than ", dirs[0], "/MANIFEST"));
    }
  }
  return first;
}

// A commit record read from a tier, with its bytes (kept to move it on).
struct CommitFile {
  CommitRecord record;
  std::string bytes;
};
// A tier's COMMIT and, if readable, its COMMIT.prev (else why not: a
// damaged one only matters if that commit is asked for).
struct TierCommitFiles {
  CommitFile latest;
  std::optional<CommitFile> previous;
  absl::Status prev_status;
};

// Reads the commit records of the run directory `dir` (one tier's).
// `num_subgroups` >= 0: each must name that many subgroups (DataLoss
// otherwise). FailedPrecondition if there is no COMMIT, DataLoss if it is
// damaged.
absl::StatusOr<TierCommitFiles> ReadTierCommitFiles(const std::string& dir,
                                                    int64_t num_subgroups) {
  auto parse = [num_subgroups](
                   std::string bytes,
                   const std::string& path) -> absl::StatusOr<CommitFile> {
    MLP_ASSIGN_OR_RETURN(CommitRecord record, ParseCommitRecord(bytes, path));
    if (num_subgroups >= 0 &&
        record.subgroup_step.size() != static_cast<size_t>(num_subgroups)) {
      return absl::DataLossError(
          absl::StrCat(path, ": subgroup count mismatch"));
    }
    return CommitFile{std::move(record), std::move(bytes)};
  };
  const std::string cpath = dir + "/COMMIT";
  absl::StatusOr<std::string> bytes = ReadSmallFile(cpath);
  if (!bytes.ok()) {
    if (bytes.status().code() != absl::StatusCode::kNotFound) {
      // An I/O error (EIO, EACCES...) keeps its code: the record may be
      // there, and "no committed step" would let a resume start afresh.
      return Annotate(bytes.status(),
                      absl::StrCat("reading the commit record of ", dir));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "no committed step on ", dir, " (", bytes.status().message(), ")"));
  }
  MLP_ASSIGN_OR_RETURN(CommitFile latest, parse(std::move(*bytes), cpath));
  TierCommitFiles files{std::move(latest), std::nullopt, absl::OkStatus()};
  const std::string ppath = cpath + ".prev";
  if (auto pbytes = ReadSmallFile(ppath); pbytes.ok()) {
    absl::StatusOr<CommitFile> previous = parse(std::move(*pbytes), ppath);
    if (previous.ok()) {
      files.previous = std::move(*previous);
    } else {
      files.prev_status = previous.status();
    }
  }
  return files;
}

// kCommittedMark's text, naming commit `id`: the newest commit known to
// have reached every tier (a mark of the first format names none).
std::string EncodeCommittedMark(const CommitId& id) {
  return absl::StrCat("a commit of this run reached every tier\ncommit ",
                      id.epoch, " ", id.step, "\n");
}

// The commit that the mark of run directory `dir` names, with the mark's
// path; nullopt where there is none, it names none (the first format), or
// it cannot be read (a mark adds evidence; a commit never depends on it).
std::optional<std::pair<CommitId, std::string>> ReadCommittedMark(
    const std::string& dir) {
  const std::string path = dir + "/" + kCommittedMark;
  absl::StatusOr<std::string> bytes = ReadSmallFile(path);
  if (!bytes.ok()) return std::nullopt;
  const size_t at = bytes->find("\ncommit ");
  if (at == std::string::npos) return std::nullopt;
  std::vector<absl::string_view> fields = absl::StrSplit(
      absl::StripAsciiWhitespace(absl::string_view(*bytes).substr(at + 8)),
      ' ');
  CommitId id;
  if (fields.size() != 2 || !absl::SimpleAtoi(fields[0], &id.epoch) ||
      !absl::SimpleAtoi(fields[1], &id.step) || id.step < 0) {
    return std::nullopt;
  }
  return std::make_pair(id, path);
}

// The newest commit that the marks of the tiers `dirs` name (nullopt: none).
std::optional<std::pair<CommitId, std::string>> NewestCommittedMark(
    const std::vector<std::string>& dirs) {
  std::optional<std::pair<CommitId, std::string>> newest;
  for (const std::string& dir : dirs) {
    auto mark = ReadCommittedMark(dir);
    if (mark.has_value() &&
        (!newest.has_value() || newest->first < mark->first)) {
      newest = std::move(mark);
    }
  }
  return newest;
}

// DataLoss naming the tier whose last commit record (`latest[t]`, of tier
// directory `dirs[t]`) is older than a commit that a mark says reached
// every tier: that tier's files are an older copy (restored from a backup,
// a snapshot, a file system of another time), and a resume of the newest
// commit every tier holds would roll the run back without a word. A crash
// between the tiers' records leaves them apart before any mark names the
// newer commit; a resume that goes back on purpose rewrites the marks.
absl::Status CheckNoTierBehindTheMarks(const std::vector<std::string>& dirs,
                                       const std::vector<CommitId>& latest) {
  const auto newest = NewestCommittedMark(dirs);
  if (!newest.has_value()) return absl::OkStatus();
  std::vector<std::string> behind;
  for (size_t t = 0; t < dirs.size(); ++t) {
    if (latest[t] < newest->first) {
      behind.push_back(absl::StrCat(
          dirs[t], " (its COMMIT: ", DescribeCommit(latest[t]), ")"));
    }
  }
  if (behind.empty()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "the commit of ", DescribeCommit(newest->first),
      " reached every tier of the run (", newest->second, "), but ",
      absl::StrJoin(behind, " and "), behind.size() == 1 ? " holds" : " hold",
      " an older copy of the run's files (restored from a backup or a "
      "snapshot?): resuming would roll the run back silently. Restore "
      "those files as of that commit; to resume the older commit anyway, "
      "remove the ",
      kCommittedMark, " file of every tier"));
}

std::atomic<internal_engine::TierFreeBytesFn> g_tier_free_bytes{nullptr};

// The free bytes of the file system holding `path` (nullopt: unknown).
std::optional<uint64_t> TierFreeBytes(const std::string& path) {
  if (internal_engine::TierFreeBytesFn fn = g_tier_free_bytes.load()) {
    return fn(path);
  }
  struct statvfs vfs;
  if (statvfs(path.c_str(), &vfs) != 0) return std::nullopt;
  // No blocks at all: a file system that does not say (some FUSE and
  // network ones; proc and sysfs, whose refusal comes with the first file
  // made there, naming the path), not a full one.
  if (vfs.f_blocks == 0) return std::nullopt;
  return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

// The disk space that the state files of a run of subgroups `numel` (and
// `arrays` fp32 arrays per parameter; `grads`: the baseline's gradient files
// too) already hold in its directory `run_dir`: each file's allocated bytes,
// up to the size the run gives it. A resume (or a run that reuses the
// directory) rewrites these files in place, so that space is the run's.
uint64_t ExistingRunBytes(const std::string& run_dir,
                          const std::vector<uint64_t>& numel, int arrays,
                          bool grads) {
  uint64_t total = 0;
  auto held = [&total](const std::string& path, uint64_t size) {
    struct stat st;
    if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
    total += std::min(static_cast<uint64_t>(st.st_blocks) * 512, size);
  };
  for (size_t i = 0; i < numel.size(); ++i) {
    held(absl::StrCat(run_dir, "/sg_", i, ".state"),
         SlotOffset(2, RoundUp(numel[i] * 4 * arrays)));
    if (grads)
      held(absl::StrCat(run_dir, "/sg_", i, ".grad"), RoundUp(numel[i] * 4));
  }
  return total;
}

// Removes from run directory `run_dir` (tier `tier`) the record files that a
// fresh start of a run placed as `tier_of_subgroup` does not use: those of
// subgroups placed on another tier or past the last one (an earlier start of
// the run, placed otherwise or of a larger model), and gradient files when
// `grads` is false. Their space is the tier's again. Errors name the file.
absl::Status RemoveStaleRecords(const std::string& run_dir, int tier,
                                const std::vector<int>& tier_of_subgroup,
                                bool grads) {
  DIR* d = opendir(run_dir.c_str());
  if (d == nullptr) return ErrnoStatus(errno, "opendir", run_dir);
  std::vector<std::string> stale;
  while (struct dirent* ent = readdir(d)) {
    const absl::string_view name = ent->d_name;
    if (!absl::StartsWith(name, "sg_")) continue;
    absl::string_view rest = name.substr(3);
    bool is_grad = false;
    if (absl::ConsumeSuffix(&rest, ".grad")) {
      is_grad = true;
    } else if (!absl::ConsumeSuffix(&rest, ".state")) {
      continue;
    }
    uint64_t i = 0;
    if (rest.empty() || rest.size() > 9 ||
        !std::all_of(rest.begin(), rest.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(rest, &i)) {
      continue;
    }
    const bool used = i < tier_of_subgroup.size() &&
                      tier_of_subgroup[i] == tier && (grads || !is_grad);
    if (!used) stale.push_back(std::string(name));
  }
  closedir(d);
  for (const std::string& name : stale) {
    const std::string path = absl::StrCat(run_dir, "/", name);
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoStatus(errno, "removing a record file of an earlier start",
                         path);
    }
  }
  return absl::OkStatus();
}

// Removes from run directory `run_dir` the temporary files that
// WriteFileAtomically leaves behind when its process dies before the rename:
// `<name>.tmp.<pid>` for each file of the run it writes (COMMIT, COMMIT.prev,
// kCommittedMark, MANIFEST). Called with the run's lock held, so no live
// process writes there: each is a dead writer's, which nothing else ever
// removes. Only regular files of exactly those names go (a symlink or a
// directory of such a name stays, and none is followed). Best effort, and
// not synced: one that stays, or comes back after a crash, goes at the next
// start.
void RemoveDeadWritersTemporaries(const std::string& run_dir) {
  DIR* d = opendir(run_dir.c_str());
  if (d == nullptr) return;
  const int dir_fd = dirfd(d);
  std::vector<std::string> dead;
  while (struct dirent* ent = readdir(d)) {
    const absl::string_view name = ent->d_name;
    bool temporary = false;
    for (const absl::string_view written :
         {"COMMIT", "COMMIT.prev", kCommittedMark, "MANIFEST"}) {
      absl::string_view pid = name;
      if (!absl::ConsumePrefix(&pid, written) ||
          !absl::ConsumePrefix(&pid, ".tmp.")) {
        continue;
      }
      // getpid() as StrCat writes it: decimal, no sign or leading zero.
      int32_t value = 0;
      temporary = !pid.empty() && pid.size() <= 10 && pid[0] != '0' &&
                  std::all_of(pid.begin(), pid.end(), absl::ascii_isdigit) &&
                  absl::SimpleAtoi(pid, &value) && value > 0;
      break;
    }
    if (!temporary) continue;
    struct stat st;
    if (fstatat(dir_fd, ent->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode)) {
      dead.push_back(std::string(name));
    }
  }
  // unlinkat removes the name itself, never what a link names.
  for (const std::string& name : dead) unlinkat(dir_fd, name.c_str(), 0);
  closedir(d);
}

}  // namespace

namespace internal_engine {
void SetTierFreeBytesForTesting(TierFreeBytesFn fn) {
  g_tier_free_bytes.store(fn);
}

uint64_t BytesUnderForTesting(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return 0;
  uint64_t bytes = static_cast<uint64_t>(st.st_blocks) * 512;
  if (!S_ISDIR(st.st_mode)) return bytes;
  if (DIR* d = opendir(path.c_str())) {
    while (struct dirent* ent = readdir(d)) {
      const std::string name = ent->d_name;
      if (name != "." && name != "..") {
        bytes += BytesUnderForTesting(path + "/" + name);
      }
    }
    closedir(d);
  }
  return bytes;
}
}  // namespace internal_engine

absl::StatusOr<std::string> TierLockPrefix(const std::string& lock_dir,
                                           const std::string& tier_dir) {
  std::string dir = lock_dir;
  if (dir.empty()) {
    struct stat st;
    const bool shm = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) &&
                     access("/dev/shm", W_OK | X_OK) == 0;
    dir = shm ? "/dev/shm" : "/tmp";
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0)
    return ErrnoStatus(errno, "tier lock directory: stat", dir);
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier lock directory ", dir, " is not a directory"));
  }
  // Resolved, as the tier is: one name for the lock however the directory
  // is spelt (relative, through a symlink), which is also the name a fork's
  // child finds its descriptors under (/proc/self/fd).
  char real_dir[PATH_MAX];
  if (realpath(dir.c_str(), real_dir) == nullptr)
    return ErrnoStatus(errno, "tier lock directory: realpath", dir);
  char real[PATH_MAX];
  if (realpath(tier_dir.c_str(), real) == nullptr)
    return ErrnoStatus(errno, "realpath", tier_dir);
  return absl::StrCat(real_dir, "/mlp_offload_tier_lock.", getuid(), ".",
                      absl::Hex(StableHash(real), absl::kZeroPad16));
}

absl::StatusOr<std::string> SharedThrottlePath(const std::string& lock_dir,
                                               const std::string& tier_dir) {
  MLP_ASSIGN_OR_RETURN(std::string prefix, TierLockPrefix(lock_dir, tier_dir));
  return prefix + ".throttle";
}

struct Engine::Impl {
  EngineConfig config;
  Plan plan;
  // What the plan was made from (a resume plans again for the placement
  // its records have).
  PlannerInput planner_input;
  uint64_t run_id = 0;
  ThreadPool pool;

  struct Tier {
    std::string dir;  // <path>/<run_name>
    std::unique_ptr<TierChannel> channel;
    FaultInjectingEngine* faults = nullptr;
    std::unique_ptr<RunLock> run_lock;
    std::string manifest;  // the bytes of dir/MANIFEST, as written or read
    // Whether this Create made `dir` (mkdir returned 0): only such a
    // directory may go again when Create fails (RemoveMadeRunDirs).
    bool made_dir = false;
  };
  std::vector<Tier> tiers;
  std::atomic<bool> interrupted{false};  // SetInterrupted

  // Per subgroup.
  std::vector<uint64_t> numel;
  std::vector<uint64_t> payload_bytes;  // numel * 4 * arrays
  std::vector<uint64_t> record_bytes;   // aligned payload
  std::vector<std::unique_ptr<File>> state_files;
  std::vector<std::unique_ptr<File>> grad_files;  // baseline only
  std::vector<int> current_slot;    // slot with the latest on-disk version
  std::vector<int> committed_slot;  // slot named by the last commit
  std::vector<int64_t> disk_step;   // step of the latest on-disk version
  // Its payload checksum (0: not known, from a first-format commit record):
  // tells it from another record of the same step count.
  std::vector<uint64_t> disk_checksum;
  // A cached record replaced outside a step (WriteSubgroup, a checkpoint
  // load) whose step may equal disk_step.
  std::vector<bool> rewritten;  // under mu, as the vectors above
  // The fdatasync of its state file failed since its latest record was
  // written: that record may not be on the disk, though the next fdatasync
  // would succeed (Linux reports a writeback error once). It is written
  // again before a commit names it.
  std::vector<bool> sync_lost;   // under mu
  std::vector<int64_t> sg_step;  // updates applied (latest version)
  std::vector<bool> initialized;
  std::vector<bool> grad_nonfinite;  // baseline: seen at offload time
  std::vector<bool> grad_offloaded;  // baseline: fp32 grad on the tier
  std::vector<bool> done_in_step;    // for a step resumed after a failure
  // Done in this step without an update: left on the tier by BeginStep's
  // skip flags, or passed through with Done(false). A failed step forgets
  // them (its retry may have gradients for them).
  enum Untouched : uint8_t { kUpdated = 0, kLeftOnTier, kPassedThrough };
  std::vector<uint8_t> untouched_in_step;

  Mutex mu;
  std::vector<Buffer> buffers ABSL_GUARDED_BY(mu);
  std::vector<int> buffer_of ABSL_GUARDED_BY(mu);  // subgroup -> buffer or -1
  int buffers_in_use ABSL_GUARDED_BY(mu) = 0;
  absl::Status step_error ABSL_GUARDED_BY(mu);  // first I/O error of the step
  int grad_writes ABSL_GUARDED_BY(mu) =
      0;  // baseline gradient writes in flight
  absl::Status grad_error ABSL_GUARDED_BY(mu);  // the first one that failed
  // Per subgroup: its gradient writes in flight (at most one: a new one
  // waits, so that the last offload is the one that lands last).
  std::vector<int> grad_writes_of ABSL_GUARDED_BY(mu);
  int peak_in_use ABSL_GUARDED_BY(mu) = 0;

  int64_t steps_done = 0;
  int64_t epoch = 0;  // SetEpoch: the epoch of the commits made from now
  // The last commit every tier holds (step -1: none yet).
  CommitId committed;
  // The commits every tier holds (COMMIT or COMMIT.prev), newest first: the
  // last one and, where every tier kept it, the one before.
  std::vector<CommitId> kept;
  // Per tier, the commit record its COMMIT file holds (empty: none yet);
  // the next commit moves it to COMMIT.prev, unless `commit_partial`: the
  // record is an attempt that did not reach every tier, which COMMIT.prev
  // (the last commit every tier holds) must outlive.
  std::vector<std::string> commit_bytes;
  std::vector<bool> commit_partial;
  // The commit whose last attempt failed, if any: RetryCommit writes it
  // while the state is still that commit's (same epoch and step count).
  std::optional<CommitId> failed_commit;
  // Whether this process has written kCommittedMark on every tier; if
  // not, why the last try failed (OK: not tried yet, or written).
  bool committed_marked = false;
  absl::Status mark_error;
  bool resumed = false;

  // The step in progress.
  bool in_step = false;
  bool step_failed = false;  // an earlier attempt of this step failed
  std::vector<int> order;
  size_t pos = 0;
  size_t next_read = 0;
  StepStats stats;
  MonoTime step_start;

  explicit Impl(const EngineConfig& c)
      : config(c), pool(std::max(1, c.compute_threads)) {}

  int arrays() const { return 1 + config.num_state_arrays; }
  bool eager_grads() const {
    return !config.techniques.delayed_grad_conversion;
  }
  int n() const { return static_cast<int>(numel.size()); }
  uint64_t slot_bytes(int i) const {
    return kRecordHeaderBytes + record_bytes[i];
  }
  std::string where(int i, int slot) const {
    return absl::StrCat(state_files[i]->path(), " (subgroup ", i, ", slot ",
                        slot, ")");
  }

  // --- buffers ---------------------------------------------------------
  int FindFreeBuffer() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (size_t b = 0; b < buffers.size(); ++b) {
      if (buffers[b].state == BufState::kFree) return static_cast<int>(b);
    }
    return -1;
  }
  void Claim(int b, int subgroup, BufState state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    buffers[b].subgroup = subgroup;
    buffers[b].state = state;
    buffers[b].io_status = absl::OkStatus();
    if (subgroup >= 0) buffer_of[subgroup] = b;
    ++buffers_in_use;
    peak_in_use = std::max(peak_in_use, buffers_in_use);
  }
  void Free(int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (buffers[b].subgroup >= 0 && buffer_of[buffers[b].subgroup] == b) {
      buffer_of[buffers[b].subgroup] = -1;
    }
    buffers[b].subgroup = -1;
    buffers[b].state = BufState::kFree;
    buffers[b].pending = 0;
    --buffers_in_use;
  }
  bool IoInFlight() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return std::any_of(buffers.begin(), buffers.end(),
                       [](const Buffer& buf) { return buf.pending > 0; });
  }
  // Blocks until a buffer is free (writes behind complete) and claims it;
  // the I/O error that makes that impossible otherwise. When no request in
  // flight can free one (every buffer holds a record: after a step whose
  // writes failed, say), outside a step a cached record is written back to
  // make room (its write's error otherwise); within a step that cannot
  // happen, and Internal names the counts instead of waiting forever.
  absl::StatusOr<int> WaitAndClaimFree(int subgroup, BufState state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (;;) {
      auto any_free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
        return FindFreeBuffer() >= 0 || (in_step && !step_error.ok()) ||
               !IoInFlight();
      };
      mu.Await(any_free);
      const int b = FindFreeBuffer();
      if (b >= 0) {
        Claim(b, subgroup, state);
        return b;
      }
      // (Outside a step, step_error is an earlier call's, already reported.)
      if (in_step && !step_error.ok()) return step_error;
      if (!in_step) {
        MLP_RETURN_IF_ERROR(EvictCached(subgroup));
        continue;
      }
      int cached = 0;
      for (const Buffer& buf : buffers)
        cached += buf.state == BufState::kCached;
      return absl::InternalError(absl::StrCat(
          "no host buffer can become free for subgroup ", subgroup, ": all ",
          buffers.size(), " are held (", cached,
          " cached, plan: ", plan.num_cached, " cached and ", plan.num_buffers,
          " streaming) and no I/O is in flight"));
    }
  }
  // Outside a step: frees the buffer of a cached record (other than
  // subgroup `for_subgroup`'s), writing it back first unless its latest
  // version is on disk; a record already there is taken first. The write's
  // error (naming the subgroup) leaves the record cached.
  absl::Status EvictCached(int for_subgroup) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    int victim = -1;
    for (size_t b = 0; b < buffers.size(); ++b) {
      const Buffer& buf = buffers[b];
      const int i = buf.subgroup;
      if (buf.state != BufState::kCached || buf.pending > 0 || i < 0 ||
          i == for_subgroup) {
        continue;
      }
      if (victim < 0 || OnDisk(i)) victim = static_cast<int>(b);
      if (OnDisk(i)) break;
    }
    if (victim < 0) {
      return absl::InternalError(absl::StrCat(
          "no host buffer can become free for subgroup ", for_subgroup,
          ": all ", buffers.size(), " hold records in use"));
    }
    const int i = buffers[victim].subgroup;
    if (!OnDisk(i)) {
      MLP_RETURN_IF_ERROR(
          Annotate(WriteNow(i, victim),
                   absl::StrCat("writing back subgroup ", i,
                                " to make room for subgroup ", for_subgroup)));
    }
    Free(victim);
    return absl::OkStatus();
  }
  // Whether subgroup i's latest version is the one on disk.
  bool OnDisk(int i) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return current_slot[i] >= 0 && disk_step[i] == sg_step[i] && !rewritten[i];
  }
  float* Payload(int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return PayloadUnlocked(b);
  }
  // For the thread that owns buffer b (the buffers vector never changes
  // after Create, so the address is stable).
  float* PayloadUnlocked(int b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return reinterpret_cast<float*>(buffers[b].mem.as<char>() +
                                    kRecordHeaderBytes);
  }
  float* GradArea(int b, int i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return reinterpret_cast<float*>(buffers[b].mem.as<char>() +
                                    kRecordHeaderBytes + record_bytes[i]);
  }

  // --- I/O -------------------------------------------------------------
  void OnIoDone(int b, uint64_t bytes, int tier, bool is_read,
                absl::StatusOr<size_t> r) {
    MutexLock l(&mu);
    Buffer& buf = buffers[b];
    if (!r.ok() && is_read && absl::IsOutOfRange(r.status())) {
      // The io layer's end of file: a state file shorter than its records.
      r = absl::DataLossError(absl::StrCat(r.status().message(),
                                           " (truncated state of subgroup ",
                                           buf.subgroup, ")"));
    }
    if (!r.ok() && buf.io_status.ok()) buf.io_status = r.status();
    // A step's statistics count its own transfers and the gradient
    // offload before it, not the I/O of initialisation, state reads or
    // checkpoints between steps.
    if (r.ok() && (in_step || buf.grad_write)) {
      if (is_read) {
        stats.bytes_read[tier] += bytes;
      } else {
        stats.bytes_written[tier] += bytes;
      }
    }
    --buf.pending;
    if (buf.grad_write) {
      if (buf.pending == 0) {
        buf.grad_write = false;
        --grad_writes;
        --grad_writes_of[buf.grad_subgroup];
        buf.grad_subgroup = -1;
        if (!buf.io_status.ok()) {
          if (grad_error.ok()) grad_error = buf.io_status;
          buf.io_status = absl::OkStatus();
        }
        if (buf.scratch) {
          buf.scratch = false;
          Free(b);
        }
      }
      return;
    }
    if (!r.ok() && step_error.ok()) step_error = r.status();
    if (buf.pending == 0 && buf.write_slot >= 0 && buf.io_status.ok()) {
      // A write landed: it is now the subgroup's latest on-disk version, and
      // a streaming buffer is free again.
      WriteLanded(b);
      if (buf.state == BufState::kWriting) Free(b);
    }
  }

  // Issues the read of subgroup i's latest version (and its baseline
  // gradient) into buffer b. Called with mu held; completions take mu.
  void IssueRead(int i, int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Buffer& buf = buffers[b];
    const int t = plan.tier_of_subgroup[i];
    buf.from_disk = true;
    IoRequest req;
    req.op = IoOp::kRead;
    req.file = state_files[i].get();
    req.offset = SlotOffset(current_slot[i], record_bytes[i]);
    req.length = slot_bytes(i);
    req.buffer = buf.mem.data();
    ++buf.pending;
    uint64_t len = req.length;
    tiers[t].channel->Submit(req, [this, b, len, t](absl::StatusOr<size_t> r) {
      OnIoDone(b, len, t, true, std::move(r));
    });
    if (eager_grads() && in_step) IssueGradRead(i, b);
  }

  // The baseline's fp32 gradient of subgroup i, into buffer b's grad area.
  void IssueGradRead(int i, int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Buffer& buf = buffers[b];
    const int t = plan.tier_of_subgroup[i];
    {
      IoRequest g;
      g.op = IoOp::kRead;
      g.file = grad_files[i].get();
      g.offset = 0;
      g.length = RoundUp(numel[i] * 4);
      g.buffer = GradArea(b, i);
      ++buf.pending;
      uint64_t glen = g.length;
      tiers[t].channel->Submit(g, [this, b, glen, t](absl::StatusOr<size_t> r) {
        OnIoDone(b, glen, t, true, std::move(r));
      });
    }
  }

  int WriteSlotFor(int i) const {
    if (committed_slot[i] >= 0) return 1 - committed_slot[i];
    return current_slot[i] < 0 ? 0 : 1 - current_slot[i];
  }
  // After a failed write of a new record of subgroup i from buffer b (its
  // step count already set; `old_step` the one before): with `keep` (the
  // write went over the subgroup's only copy of its latest version) the new
  // record stays in memory as the latest version, which a commit or an
  // eviction writes, as after a failed write of a step; else nothing changed
  // (the subgroup keeps its version on disk, or stays uninitialised: no
  // commit may name a slot it never wrote).
  void SettleFailedRewrite(int i, int b, bool keep, int64_t old_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (keep) {
      initialized[i] = true;
      rewritten[i] = true;
      buffers[b].state = BufState::kCached;
      SupersedeIncompleteStep(i);
    } else {
      sg_step[i] = old_step;
      Free(b);
    }
  }
  // Whether the next write of subgroup i goes to the slot that holds its
  // latest version on disk (written after its commit): that version is gone
  // if the write fails part-way.
  bool OverwritesLatest(int i) const {
    return current_slot[i] >= 0 && WriteSlotFor(i) == current_slot[i];
  }

  // Seals buffer b's header for subgroup i at its current step and issues
  // the write to the slot that does not hold the committed version.
  // `checksum` is the payload's in record format `format_version`.
  void IssueWrite(int i, int b, uint64_t checksum, uint32_t format_version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Buffer& buf = buffers[b];
    const int t = plan.tier_of_subgroup[i];
    RecordHeader h;
    h.run_id = run_id;
    h.subgroup = static_cast<uint32_t>(i);
    h.num_arrays = static_cast<uint32_t>(arrays());
    h.numel = numel[i];
    h.step = sg_step[i];
    h.payload_bytes = payload_bytes[i];
    h.payload_checksum = checksum;
    h.format_version = format_version;
    EncodeRecordHeader(h, buf.mem.data());
    buf.write_slot = WriteSlotFor(i);
    buf.write_checksum = checksum;
    IoRequest req;
    req.op = IoOp::kWrite;
    req.file = state_files[i].get();
    req.offset = SlotOffset(buf.write_slot, record_bytes[i]);
    req.length = slot_bytes(i);
    req.buffer = buf.mem.data();
    ++buf.pending;
    uint64_t len = req.length;
    tiers[t].channel->Submit(req, [this, b, len, t](absl::StatusOr<size_t> r) {
      OnIoDone(b, len, t, false, std::move(r));
    });
  }

  // Waits for buffer b's I/O; on success of a write, records the new slot.
  absl::Status WaitIo(int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto idle = [this, b]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return buffers[b].pending == 0;
    };
    mu.Await(idle);
    return buffers[b].io_status;
  }

  // Makes the write of buffer b (complete, OK) the subgroup's latest version.
  void WriteLanded(int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    int i = buffers[b].subgroup;
    current_slot[i] = buffers[b].write_slot;
    disk_step[i] = sg_step[i];
    disk_checksum[i] = buffers[b].write_checksum;
    rewritten[i] = false;
    sync_lost[i] = false;  // the whole record written again since
    buffers[b].write_slot = -1;
  }

  // Completes every request in flight. A failed write leaves its record
  // cached (nothing is lost: the old slot on disk is intact, the new version
  // is in memory); a failed read is dropped. Returns the first error.
  absl::Status DrainWrites() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Status first = step_error;
    for (size_t b = 0; b < buffers.size(); ++b) {
      absl::Status s = WaitIo(static_cast<int>(b));
      Buffer& buf = buffers[b];
      if (buf.write_slot >= 0) {  // a write that did not land
        if (first.ok()) first = s;
        buf.write_slot = -1;
        buf.io_status = absl::OkStatus();
        buf.state = BufState::kCached;
      } else if (!s.ok() && buf.state == BufState::kReading) {
        if (first.ok()) first = s;
        Free(static_cast<int>(b));
      } else if (!s.ok() && buf.state == BufState::kCached) {
        // A failed read into a cached record (the baseline's gradient): the
        // record stays, and the next read into it must not inherit the error.
        if (first.ok()) first = s;
        buf.io_status = absl::OkStatus();
      }
    }
    step_error = absl::OkStatus();
    return first;
  }

  // Verifies a record that came from disk: header fields and checksum.
  absl::Status VerifyRecord(int i, int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Buffer& buf = buffers[b];
    if (!buf.from_disk) return absl::OkStatus();
    std::string w = where(i, current_slot[i]);
    if (sg_step[i] > disk_step[i] || rewritten[i]) {
      // The latest version was held in memory only, and is gone: the disk's
      // older record must not silently take its place.
      return absl::DataLossError(
          absl::StrCat("subgroup ", i, ": its latest version (step ",
                       sg_step[i], rewritten[i] ? ", rewritten" : "",
                       ") was held in memory only and is lost; ", w,
                       " holds step ", disk_step[i]));
    }
    MLP_ASSIGN_OR_RETURN(
        RecordHeader h,
        DecodeRecordHeader(buf.mem.data(), kRecordHeaderBytes, w));
    if (h.subgroup != static_cast<uint32_t>(i) || h.numel != numel[i] ||
        h.num_arrays != static_cast<uint32_t>(arrays()) || h.run_id != run_id) {
      return absl::DataLossError(
          absl::StrCat(w, ": record belongs to another subgroup or run"));
    }
    if (h.step != disk_step[i]) {
      // A valid record of another step: the slot was rewritten after the
      // commit that names it (or the commit names the wrong slot).
      return absl::DataLossError(
          absl::StrCat(w, ": record holds step ", h.step, ", expected step ",
                       disk_step[i], " (overwritten after its commit)"));
    }
    if (disk_checksum[i] != 0 && h.payload_checksum != disk_checksum[i]) {
      // The same step count, another state (a load set the count back).
      return absl::DataLossError(absl::StrCat(
          w, ": record holds another state of step ", h.step,
          " than the one its commit names (overwritten after its commit)"));
    }
    if (config.verify_checksums) {
      // The buffer belongs to this thread until it is handed on, so the
      // checksum runs without the lock and completions keep flowing.
      const float* payload = Payload(b);
      const uint64_t bytes = payload_bytes[i];
      uint64_t sum;
      mu.Unlock();
      const MonoTime hash_start = MonoNow();
      sum = PayloadChecksum(payload, bytes, &pool, h.format_version);
      const double hashed = SecondsSince(hash_start);
      mu.Lock();
      // A step's own (as its bytes): not the reads of a state access or a
      // checkpoint between steps.
      if (in_step) stats.checksum_seconds += hashed;
      if (sum != h.payload_checksum) {
        return absl::DataLossError(
            absl::StrCat(w, ": payload checksum mismatch (corrupt state)"));
      }
    }
    buf.from_disk = false;
    sg_step[i] = h.step;
    return absl::OkStatus();
  }

  // Brings subgroup i into a buffer outside a step (state access,
  // checkpoints). Returns the buffer; `claimed` says whether the caller must
  // free it afterwards (it was not cached).
  absl::StatusOr<int> Resident(int i, bool* claimed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!initialized[i]) {
      return absl::FailedPreconditionError(
          absl::StrCat("subgroup ", i, " is not initialised"));
    }
    int b = buffer_of[i];
    if (b >= 0) {
      MLP_RETURN_IF_ERROR(WaitIo(b));
      *claimed = false;
      return b;
    }
    MLP_ASSIGN_OR_RETURN(b, WaitAndClaimFree(i, BufState::kReading));
    IssueRead(i, b);
    absl::Status s = WaitIo(b);
    if (s.ok()) s = VerifyRecord(i, b);
    if (!s.ok()) {
      Free(b);
      return s;
    }
    *claimed = true;
    return b;
  }

  // The subgroups `which`, the tiers taking turns: each tier's own in the
  // order given.
  std::vector<int> TierTurns(const std::vector<int>& which) const {
    std::vector<std::vector<int>> per_tier(tiers.size());
    for (int i : which) per_tier[plan.tier_of_subgroup[i]].push_back(i);
    std::vector<int> order;
    for (size_t k = 0; order.size() < which.size(); ++k) {
      for (const std::vector<int>& mine : per_tier) {
        if (k < mine.size()) order.push_back(mine[k]);
      }
    }
    return order;
  }

  // What a call over the subgroups `which` (ReadSubgroups and the like,
  // `what`) checks before touching anything: outside a step, each subgroup
  // at most once. Sets index_of[i] to subgroup i's index in `which` (-1:
  // not there).
  absl::Status IndexBatch(const char* what, const std::vector<int>& which,
                          std::vector<int>* index_of) const {
    if (in_step) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " during a step"));
    }
    index_of->assign(n(), -1);
    for (size_t k = 0; k < which.size(); ++k) {
      const int i = which[k];
      if (i < 0 || i >= n())
        return absl::OutOfRangeError(absl::StrCat(what, ": no subgroup ", i));
      if ((*index_of)[i] >= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": subgroup ", i, " given twice"));
      }
      (*index_of)[i] = static_cast<int>(k);
    }
    return absl::OkStatus();
  }
  // IndexBatch for ReadSubgroups and WriteSubgroups (`write`), with what
  // they check of each record; `which` gets the records' subgroups.
  absl::Status CheckStateAccess(const char* what,
                                const std::vector<SubgroupState>& records,
                                bool write, std::vector<int>* which,
                                std::vector<int>* record_of) const {
    for (const SubgroupState& r : records) which->push_back(r.subgroup);
    MLP_RETURN_IF_ERROR(IndexBatch(what, *which, record_of));
    for (const SubgroupState& r : records) {
      const int i = r.subgroup;
      if (static_cast<int>(r.state.size()) != config.num_state_arrays) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": ", r.state.size(), " state arrays given for subgroup ", i,
            ", the engine has ", config.num_state_arrays));
      }
      if (write && r.master == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": no master given for subgroup ", i));
      }
      if (write && r.step < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": negative step ", r.step, " for subgroup ", i));
      }
    }
    return absl::OkStatus();
  }

  // Writes a new record of each subgroup of `which` (each at most once,
  // outside a step), the tiers taking turns, with writes in flight on every
  // tier at once as the buffers allow. fill(i, payload) puts subgroup i's
  // payload in place and returns its step count; it runs without the lock
  // (the buffer is the caller's, no I/O in flight on it) while the other
  // writes complete. A record cached in memory is filled there and, unless
  // `write_cached`, written back only when evicted (WriteSubgroup), else
  // now (InitializeSubgroup). A write that fails changes nothing, unless it
  // went over the only copy of the subgroup's latest version (cached, or on
  // disk after its commit): the new record is then kept in memory as the
  // latest version. After an error no further write starts; the ones in
  // flight finish, and the first error is returned, naming its subgroup
  // ("<what> subgroup i").
  absl::Status WriteRecords(
      const std::vector<int>& which, const char* what, bool write_cached,
      const std::function<int64_t(int i, float* payload)>& fill)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (which.empty()) return absl::OkStatus();
    failed_commit.reset();  // the state is no longer that commit's
    struct Flight {
      int subgroup;
      int buffer;
      int64_t old_step;
      bool keep_if_failed;
    };
    std::deque<Flight> flying;
    absl::Status first;
    auto settle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      const Flight f = flying.front();
      flying.pop_front();
      absl::Status s = FinishWrite(f.buffer);
      if (!s.ok()) {
        SettleFailedRewrite(f.subgroup, f.buffer, f.keep_if_failed, f.old_step);
        if (first.ok()) {
          first = Annotate(s, absl::StrCat(what, " subgroup ", f.subgroup));
        }
        return;
      }
      initialized[f.subgroup] = true;
      SupersedeIncompleteStep(f.subgroup);
      // A record the next step starts with stays cached (cache reuse), if
      // the cache has room for it: a state written back into a new engine
      // starts with a warm cache, and a record kept beyond the cache's size
      // would take a streaming buffer that the steps and reads need.
      if (KeepInCache(f.subgroup, f.buffer)) {
        buffers[f.buffer].state = BufState::kCached;
      } else {
        Free(f.buffer);
      }
    };
    // SetInterrupted: no further write starts.
    auto stop_if_interrupted = [&](int i) {
      if (!interrupted.load()) return false;
      first = absl::CancelledError(
          absl::StrCat(what, " subgroup ", i, ": interrupted"));
      return true;
    };
    for (int i : TierTurns(which)) {
      if (stop_if_interrupted(i)) break;
      int b = buffer_of[i];
      const bool cached = b >= 0;
      if (cached) {
        absl::Status s = WaitIo(b);
        if (!s.ok()) {
          first = s;
          break;
        }
      } else {
        // The writes in flight hold the buffers: the oldest lands first.
        while (FindFreeBuffer() < 0 && !flying.empty()) settle();
        if (!first.ok() || stop_if_interrupted(i)) break;
        absl::StatusOr<int> claimed = WaitAndClaimFree(i, BufState::kInUse);
        if (!claimed.ok()) {
          first = claimed.status();
          break;
        }
        b = *claimed;
      }
      float* payload = Payload(b);
      const uint64_t bytes = payload_bytes[i];
      const bool write = !cached || write_cached;
      uint64_t checksum = 0;
      mu.Unlock();
      const int64_t step = fill(i, payload);
      if (write) {
        checksum = PayloadChecksum(payload, bytes, &pool, kStateFormatVersion);
      }
      mu.Lock();
      buffers[b].from_disk = false;
      if (!write) {
        sg_step[i] = step;
        initialized[i] = true;
        SupersedeIncompleteStep(i);
        rewritten[i] = true;
        continue;  // written back when evicted
      }
      // The header carries the step count: the old one comes back if the
      // write fails and changed nothing.
      flying.push_back({i, b, sg_step[i], cached || OverwritesLatest(i)});
      sg_step[i] = step;
      IssueWrite(i, b, checksum, kStateFormatVersion);
    }
    while (!flying.empty()) settle();
    return first;
  }

  // Calls visit(i, b) for each subgroup i of `which`, with its verified
  // record in buffer b, outside a step. The tiers take turns, each
  // streaming its own subgroups in order, and records are read ahead (one
  // per tier in flight, as free buffers allow) while `visit` uses the
  // current one: every tier reads meanwhile. The first error (a read, a
  // record, or visit's) stops the walk.
  absl::Status VisitRecords(
      const std::vector<int>& which,
      const std::function<absl::Status(int i, int b)>& visit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const std::vector<int> order = TierTurns(which);
    struct Ahead {
      int subgroup;
      int buffer;
    };
    std::deque<Ahead> ahead;
    // The first record of `order` not considered for reading ahead.
    size_t next = 0;
    auto read_ahead = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      while (ahead.size() < tiers.size() && next < order.size() &&
             !interrupted.load()) {
        const int j = order[next];
        if (buffer_of[j] >= 0) {  // in memory already
          ++next;
          continue;
        }
        if (!initialized[j]) return;  // Resident says so, in its turn
        const int b = FindFreeBuffer();
        if (b < 0) return;
        Claim(b, j, BufState::kReading);
        IssueRead(j, b);
        ahead.push_back({j, b});
        ++next;
      }
    };
    auto drop_ahead = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      for (const Ahead& a : ahead) {
        WaitIo(a.buffer).IgnoreError();
        Free(a.buffer);
      }
      ahead.clear();
    };
    read_ahead();  // every tier's first record, the first one's included
    for (size_t k = 0; k < order.size(); ++k) {
      const int i = order[k];
      if (interrupted.load()) {  // SetInterrupted
        drop_ahead();
        return absl::CancelledError(
            absl::StrCat("reading subgroup ", i, ": interrupted"));
      }
      next = std::max(next, k + 1);
      bool claimed = false;
      int b = -1;
      if (!ahead.empty() && ahead.front().subgroup == i) {
        b = ahead.front().buffer;
        ahead.pop_front();
        claimed = true;
        absl::Status s = WaitIo(b);
        if (s.ok()) s = VerifyRecord(i, b);
        if (!s.ok()) {
          Free(b);
          drop_ahead();
          return s;
        }
      } else {
        // Not read ahead: in memory, or there was no free buffer then (this
        // iteration's Free left one).
        absl::StatusOr<int> r = Resident(i, &claimed);
        if (!r.ok()) {
          drop_ahead();
          return r.status();
        }
        b = *r;
      }
      read_ahead();
      absl::Status s = visit(i, b);
      if (claimed) Free(b);
      if (!s.ok()) {
        drop_ahead();
        return s;
      }
    }
    return absl::OkStatus();
  }

  // The step ends without its EndStep going through (an I/O error, a
  // subgroup not updated, AbortStep): the next one resumes it. The
  // subgroups it did not update are not done by it (its retry takes them
  // again, and counts the ones it leaves on their tiers).
  void StepFailed() {
    in_step = false;
    step_failed = true;
    for (int i = 0; i < n(); ++i) {
      if (untouched_in_step[i] == kUpdated) continue;
      done_in_step[i] = false;
      if (untouched_in_step[i] == kLeftOnTier) --stats.subgroups_left_on_tier;
    }
    std::fill(untouched_in_step.begin(), untouched_in_step.end(), kUpdated);
  }

  // Subgroup i's state was replaced from outside (a checkpoint, a state
  // dict): it is no longer part of a step that failed part-way, and once no
  // subgroup is, that step is abandoned (the next Step updates every
  // subgroup again instead of resuming it).
  void SupersedeIncompleteStep(int i) {
    if (!step_failed) return;
    done_in_step[i] = false;
    if (std::none_of(done_in_step.begin(), done_in_step.end(),
                     [](bool done) { return done; })) {
      step_failed = false;
    }
  }

  // Writes buffer b (subgroup i) synchronously to its tier.
  absl::Status WriteNow(int i, int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    IssueWrite(i, b,
               PayloadChecksum(Payload(b), payload_bytes[i], &pool,
                               kStateFormatVersion),
               kStateFormatVersion);
    return FinishWrite(b);
  }
  // Waits for the write IssueWrite started from buffer b (kept claimed).
  absl::Status FinishWrite(int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Status s = WaitIo(b);  // the completion marks the new slot
    buffers[b].write_slot = -1;
    buffers[b].io_status = absl::OkStatus();
    step_error = absl::OkStatus();
    return s;
  }

  // Whether a record of subgroup i outside a step (initialised or loaded,
  // its latest version on disk) stays cached in buffer b: with cache reuse,
  // if the next step's order starts with it (the plan's cached records) and
  // the other records cached leave room for it.
  bool KeepInCache(int i, int b) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int k = plan.num_cached;
    if (!config.techniques.cache_reuse || k <= 0) return false;
    const std::vector<int> next = plan.Order(steps_done);
    const auto first_k = next.begin() + std::min<size_t>(k, next.size());
    if (std::find(next.begin(), first_k, i) == first_k) return false;
    int others = 0;
    for (size_t c = 0; c < buffers.size(); ++c) {
      others +=
          static_cast<int>(c) != b && buffers[c].state == BufState::kCached;
    }
    return others < k;
  }

  // What Step and GradientsNonfinite check before touching anything.
  absl::Status ValidateStepInputs(
      const std::vector<SubgroupStepInput>& inputs) const;
  bool AnyGradientNonfinite(const std::vector<SubgroupStepInput>& inputs,
                            float grad_scale);

  // The baseline's offloaded gradients are used (a step ended) or dropped.
  void ClearOffloadedGradients() {
    std::fill(grad_offloaded.begin(), grad_offloaded.end(), false);
    std::fill(grad_nonfinite.begin(), grad_nonfinite.end(), false);
  }

  void ResetStats() {
    stats = StepStats();
    stats.bytes_read.assign(tiers.size(), 0);
    stats.bytes_written.assign(tiers.size(), 0);
  }

  absl::Status WriteCommit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Makes subgroup i's latest record (on disk) durable: fdatasync of its
  // state file, after writing the record again where an earlier fdatasync
  // failed (sync_lost). A failure marks it sync_lost.
  absl::Status SyncStateFile(int i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (sync_lost[i]) {
      bool claimed = false;
      MLP_ASSIGN_OR_RETURN(const int b, Resident(i, &claimed));
      absl::Status written = WriteNow(i, b);
      if (claimed) Free(b);
      MLP_RETURN_IF_ERROR(Annotate(
          written, absl::StrCat("writing subgroup ", i,
                                " again after its state file's fdatasync "
                                "failed")));
    }
    absl::Status s = absl::OkStatus();
    if (FaultInjectingEngine* f = tiers[plan.tier_of_subgroup[i]].faults) {
      s = f->SyncFault(*state_files[i]);
    }
    if (s.ok()) s = state_files[i]->Sync();
    if (!s.ok()) sync_lost[i] = true;
    return s;
  }
  // FailedPrecondition unless commit `id` would be newer than the last one.
  absl::Status CheckNewerThanCommitted(const CommitId& id) const;
  // Writes every cached record whose latest version is not on disk (it
  // stays cached), so that a commit record can name them all.
  absl::Status FlushCached() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (size_t b = 0; b < buffers.size(); ++b) {
      const int i = buffers[b].subgroup;
      if (buffers[b].state != BufState::kCached || i < 0) continue;
      MLP_RETURN_IF_ERROR(WaitIo(static_cast<int>(b)));
      if (disk_step[i] == sg_step[i] && !rewritten[i]) continue;
      MLP_RETURN_IF_ERROR(WriteNow(i, static_cast<int>(b)));
    }
    return absl::OkStatus();
  }
  // OK if tier t's MANIFEST still holds the bytes this run wrote or read.
  absl::Status CheckManifestUnchanged(size_t t) const;
  // The position in `order` of the step's next subgroup: pos, past what an
  // earlier, failed attempt of this step already updated.
  size_t NextPos() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    size_t p = pos;
    while (p < order.size() && done_in_step[order[p]]) ++p;
    return p;
  }
  // Every tier's waits for its lock and the requests its cap holds back
  // (TierChannel::SetInterrupted).
  void SetIoInterrupted(bool on) {
    for (Tier& tier : tiers) tier.channel->SetInterrupted(on);
  }
  // Checks every tier path (exists, a writable directory, no two the same)
  // without touching them; OpenTiers then creates the run directories.
  absl::Status CheckTiers();
  absl::Status OpenTiers();
  // For a failed Create: removes the run directories it made (Tier::
  // made_dir) that hold nothing but the LOCK file it took in them, and
  // drops its run locks. A directory that existed before is never touched:
  // it may hold a committed run's state.
  void RemoveMadeRunDirs();
  std::vector<std::string> real_paths;
  absl::Status LoadCommitted();

  // --- step pipeline ----------------------------------------------------
  // Keeps up to prefetch_depth reads in flight, in the step's order. Cache
  // hits are skipped without counting against the depth, so the tiers start
  // reading the first records that miss while the step begins on the hits.
  void IssueReads() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (interrupted.load(std::memory_order_relaxed)) return;
    int reading = 0;
    for (const Buffer& buf : buffers)
      reading += buf.state == BufState::kReading;
    while (next_read < order.size()) {
      int i = order[next_read];
      if (done_in_step[i]) {
        ++next_read;
        continue;
      }
      if (buffer_of[i] >= 0) {  // resident: a cache hit
        ++stats.cache_hits;
        if (eager_grads()) IssueGradRead(i, buffer_of[i]);
        ++next_read;
        continue;
      }
      if (reading >= plan.prefetch_depth) return;
      int b = FindFreeBuffer();
      if (b < 0) return;
      Claim(b, i, BufState::kReading);
      IssueRead(i, b);
      ++reading;
      ++next_read;
    }
  }

  // Engine::LoadCheckpointRecords, with the manifests already read by
  // directory (`manifests`; the others are read here).
  absl::Status LoadRecords(const std::vector<CheckpointRecord>& records,
                           std::map<std::string, Manifest> manifests);
  // The checks of a load, which change nothing: every source's manifest
  // and every record's file and header agree with this engine's subgroup
  // (size, state layout), and each file is whole. Returns the records'
  // directories, resolved (ResolveCheckpointDir); `manifests` caches the
  // manifests read, by directory.
  absl::StatusOr<std::vector<std::string>> CheckRecords(
      const std::vector<CheckpointRecord>& records,
      std::map<std::string, Manifest>& manifests) const;
  // The records of this engine's own checkpoint in `dir` (saved with its
  // subgroups), with its manifest checked against this engine's.
  absl::Status OwnCheckpoint(const std::string& dir,
                             std::vector<CheckpointRecord>* records,
                             std::map<std::string, Manifest>* manifests) const;
};

absl::Status Engine::Impl::CheckManifestUnchanged(size_t t) const {
  const std::string path = tiers[t].dir + "/MANIFEST";
  absl::StatusOr<std::string> now = ReadSmallFile(path);
  if (!now.ok()) {
    if (now.status().code() == absl::StatusCode::kNotFound) {
      return absl::NotFoundError(
          absl::StrCat(path,
                       " (the run's manifest) was deleted or moved "
                       "away while the run uses it"));
    }
    return now.status();
  }
  if (*now != tiers[t].manifest) {
    return absl::FailedPreconditionError(
        absl::StrCat(path,
                     " (the run's manifest) was changed by someone "
                     "else while the run uses it"));
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::CheckNewerThanCommitted(const CommitId& id) const {
  if (committed.step < 0 || committed < id) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the commit of ", DescribeCommit(id),
      " would not be newer than the last commit, of ",
      DescribeCommit(committed),
      ": a load set the step count back (SetEpoch to a later epoch first)"));
}

absl::Status Engine::Impl::WriteCommit() {
  const CommitId id{epoch, steps_done};
  MLP_RETURN_IF_ERROR(CheckNewerThanCommitted(id));
  failed_commit = id;  // until every tier holds the record
  // Per tier: the slot of each of its subgroups. Every subgroup must have
  // its latest version on disk (the caller flushed the cached ones), and
  // durably so before a commit record names it.
  for (int i = 0; i < n(); ++i) {
    if (current_slot[i] < 0) {
      return absl::InternalError(absl::StrCat(
          "commit: subgroup ", i, " has no record on disk (no slot written)"));
    }
    if (disk_step[i] != sg_step[i]) {
      return absl::InternalError(
          absl::StrCat("commit: subgroup ", i, " is not on disk"));
    }
    if (rewritten[i] && buffer_of[i] < 0) {
      // Replaced outside a step, then dropped before it was written (a
      // failed load): the record on disk is not its latest version.
      return absl::DataLossError(absl::StrCat(
          "commit: the latest version of subgroup ", i,
          " (rewritten by a load) was held in memory only and is lost; no "
          "commit record written"));
    }
    MLP_RETURN_IF_ERROR(SyncStateFile(i));
  }
  // A state file deleted or replaced under the run (a tier wiped) still
  // takes writes through its descriptor, on a file that no path shows: a
  // commit record naming it would promise state that no resume can find.
  // Likewise, without its lock file another process could open the run.
  constexpr absl::string_view kNoCommit =
      "no commit record written (this process still holds the state: "
      "SaveCheckpoint to a directory elsewhere keeps it)";
  for (int i = 0; i < n(); ++i) {
    absl::Status s = state_files[i]->CheckStillAtPath(
        absl::StrCat("the state of subgroup ", i));
    if (!s.ok()) return Annotate(s, kNoCommit);
  }
  for (size_t t = 0; t < tiers.size(); ++t) {
    absl::Status s = tiers[t].run_lock->CheckStillAtPath();
    if (!s.ok()) return Annotate(s, kNoCommit);
    // A resume reads the MANIFEST first: without it (or with another
    // run's), the commit record would name state no resume can use.
    s = CheckManifestUnchanged(t);
    if (!s.ok()) return Annotate(s, kNoCommit);
  }
  // Each tier's previous record moves to COMMIT.prev first. A crash between
  // two tiers' records leaves them one commit apart; Create then resumes
  // the older commit from the newer tier's COMMIT.prev, whose slots this
  // step did not touch (writes go to the slots no commit record names). The
  // ranks of a process group use the same to agree on one commit.
  commit_bytes.resize(tiers.size());
  commit_partial.resize(tiers.size(), false);
  for (size_t t = 0; t < tiers.size(); ++t) {
    CommitRecord c;
    c.id = id;
    c.subgroup_step.assign(n(), -1);
    c.subgroup_checksum.assign(n(), 0);
    c.subgroup_slot.assign(n(), 0);
    for (int i = 0; i < n(); ++i) {
      if (plan.tier_of_subgroup[i] != static_cast<int>(t)) continue;
      c.subgroup_step[i] = disk_step[i];
      c.subgroup_checksum[i] = disk_checksum[i];
      c.subgroup_slot[i] = static_cast<uint8_t>(current_slot[i]);
    }
    std::string encoded = EncodeCommitRecord(c);
    if (encoded == commit_bytes[t]) continue;  // written by a failed attempt
    if (!commit_bytes[t].empty() && !commit_partial[t]) {
      MLP_RETURN_IF_ERROR(
          WriteFileAtomically(tiers[t].dir + "/COMMIT.prev", commit_bytes[t]));
    }
    MLP_RETURN_IF_ERROR(WriteFileAtomically(tiers[t].dir + "/COMMIT", encoded));
    commit_bytes[t] = std::move(encoded);
    commit_partial[t] = true;
  }
  for (int i = 0; i < n(); ++i) committed_slot[i] = current_slot[i];
  // Every tier's COMMIT.prev is now the commit before (a tier that held a
  // failed attempt kept it there).
  kept = {id};
  if (committed.step >= 0) kept.push_back(committed);
  committed = id;
  failed_commit.reset();
  commit_partial.assign(tiers.size(), false);
  // The commit reached every tier: say so on each, so that a resume tells
  // a tier that lost its COMMIT since (refused) from a first commit that
  // reached some tiers only (nothing to resume) where no COMMIT.prev does it
  // (the run's first commit, or a re-packing's in its new directory), and a
  // tier whose files were replaced by an older copy from a crash between
  // the tiers' records (CheckNoTierBehindTheMarks). Best effort: the commit
  // is whole without it, and the next one tries again. Durable the first
  // time only: a later mark lost in a crash leaves an earlier commit named
  // (a weaker check, never a wrong one), and every tier's record of this
  // commit is durable before any mark names it.
  mark_error = absl::OkStatus();
  const std::string mark_text = EncodeCommittedMark(id);
  for (const auto& tier : tiers) {
    const std::string mark = tier.dir + "/" + kCommittedMark;
    const absl::Status written =
        WriteFileAtomically(mark, mark_text, /*durable=*/!committed_marked);
    if (!written.ok() && mark_error.ok()) {
      mark_error =
          absl::Status(written.code(),
                       absl::StrCat("writing ", mark, ": ", written.message()));
    }
  }
  committed_marked = committed_marked || mark_error.ok();
  return absl::OkStatus();
}

absl::Status Engine::Impl::CheckTiers() {
  const int num_tiers = static_cast<int>(config.tiers.size());
  real_paths.assign(num_tiers, "");
  std::vector<std::string>& real = real_paths;
  for (int t = 0; t < num_tiers; ++t) {
    const std::string& path = config.tiers[t].path;
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      return ErrnoStatus(errno, absl::StrCat("tier ", t, ": stat"), path);
    }
    if (!S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tier ", t, ": ", path, " is not a directory"));
    }
    if (access(path.c_str(), W_OK | X_OK) != 0) {
      return ErrnoStatus(errno, absl::StrCat("tier ", t, ": not writable:"),
                         path);
    }
    char buf[PATH_MAX];
    if (realpath(path.c_str(), buf) == nullptr)
      return ErrnoStatus(errno, "realpath", path);
    real[t] = buf;
    for (int u = 0; u < t; ++u) {
      if (real[u] == real[t]) {
        return absl::InvalidArgumentError(
            absl::StrCat("tiers ", u, " and ", t, " are the same directory (",
                         real[t], "): give each tier its own path"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::OpenTiers() {
  const int num_tiers = static_cast<int>(config.tiers.size());
  const std::vector<std::string>& real = real_paths;
  // What can be refused without the run directories (the io options, a
  // missing tier lock directory) is, before any is made: a refused config
  // leaves nothing behind. The engines are made here too (their options
  // are checked by making them; io_uring may be unavailable).
  std::vector<std::unique_ptr<IoEngine>> ios(num_tiers);
  std::vector<std::string> throttle_paths(num_tiers), lock_prefixes(num_tiers);
  for (int t = 0; t < num_tiers; ++t) {
    MLP_ASSIGN_OR_RETURN(ios[t], CreateIoEngine(config.io));
    if (config.tiers[t].throttle_shared) {
      absl::StatusOr<std::string> state =
          SharedThrottlePath(config.tier_lock_dir, real[t]);
      if (!state.ok()) {
        return Annotate(state.status(),
                        absl::StrCat("tier ", t, ": shared throttle"));
      }
      throttle_paths[t] = *std::move(state);
    }
    if (config.techniques.tier_lock) {
      // Node-local, shared by every run of this node on the tier.
      absl::StatusOr<std::string> prefix =
          TierLockPrefix(config.tier_lock_dir, real[t]);
      if (!prefix.ok()) {
        return Annotate(prefix.status(),
                        absl::StrCat("tier ", t, ": tier lock"));
      }
      lock_prefixes[t] = *std::move(prefix);
    }
  }
  tiers.resize(num_tiers);
  for (int t = 0; t < num_tiers; ++t) {
    Tier& tier = tiers[t];
    tier.dir = absl::StrCat(real[t], "/", config.run_name);
    if (mkdir(tier.dir.c_str(), 0700) == 0) {
      tier.made_dir = true;
      // A new directory survives a crash only once its parent is synced (the
      // commits written in it would go with it).
      absl::Status synced = SyncDirectory(real[t]);
      if (!synced.ok()) return Annotate(synced, absl::StrCat("tier ", t));
    } else if (errno != EEXIST) {
      return ErrnoStatus(errno, absl::StrCat("tier ", t, ": mkdir"), tier.dir);
    }
    struct stat st;
    if (lstat(tier.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tier ", t, ": ", tier.dir,
                       " is not a directory (a planted symlink?)"));
    }
    MLP_ASSIGN_OR_RETURN(tier.run_lock, RunLock::Acquire(tier.dir + "/LOCK"));
    // No live process writes in the directory now that the lock is ours.
    RemoveDeadWritersTemporaries(tier.dir);
    std::unique_ptr<IoEngine> io = std::move(ios[t]);
    const TierSpec& spec = config.tiers[t];
    if (spec.throttle_shared) {
      SharedThrottleOptions shared;
      shared.state_path = throttle_paths[t];
      shared.read_bytes_per_sec = spec.throttle_read_bytes_per_sec;
      shared.write_bytes_per_sec = spec.throttle_write_bytes_per_sec;
      shared.contention = spec.throttle_contention;
      shared.half_duplex = spec.throttle_half_duplex;
      // A rank stopped inside the file's 32-byte section holds the others
      // up no longer than one stopped while holding the tier lock.
      shared.lock_timeout = config.tier_lock_timeout;
      // The error names the state file (node-local, SharedThrottlePath).
      MLP_ASSIGN_OR_RETURN(io,
                           MakeSharedThrottledEngine(std::move(io), shared));
    } else if (spec.throttle_read_bytes_per_sec > 0 ||
               spec.throttle_write_bytes_per_sec > 0) {
      io = MakeThrottledEngine(std::move(io), spec.throttle_read_bytes_per_sec,
                               spec.throttle_write_bytes_per_sec,
                               spec.throttle_half_duplex);
    }
    if (config.fault_injection) {
      auto fi = std::make_unique<FaultInjectingEngine>(std::move(io));
      tier.faults = fi.get();
      io = std::move(fi);
    }
    std::vector<std::unique_ptr<TierLock>> locks;
    if (config.techniques.tier_lock) {
      const std::string& base = lock_prefixes[t];
      std::vector<std::string> paths = {base};
      if (config.tier_lock_mode == TierLockMode::kPerDirection) {
        paths = {base + ".read", base + ".write"};
      }
      for (const std::string& path : paths) {
        absl::StatusOr<std::unique_ptr<TierLock>> lock =
            TierLock::Open(path, std::max(1, config.tier_lock_slots));
        if (!lock.ok()) {
          // Named as a missing one is (TierLockPrefix): /proc or a read-only
          // directory gets this far, and "open <file>: ..." alone does not
          // say which setting to change.
          return Annotate(lock.status(), absl::StrCat("tier ", t,
                                                      ": tier lock: tier lock "
                                                      "directory ",
                                                      ParentDirectory(path)));
        }
        locks.push_back(*std::move(lock));
      }
    }
    tier.channel = std::make_unique<TierChannel>(
        std::move(io), std::move(locks), config.tier_lock_timeout);
    MLP_RETURN_IF_ERROR(tier.channel->start_status());
  }
  return absl::OkStatus();
}

void Engine::Impl::RemoveMadeRunDirs() {
  for (Tier& tier : tiers) {
    if (!tier.made_dir) continue;
    if (tier.run_lock != nullptr) {
      // This Create made the directory and holds its lock: what it holds
      // besides is what this Create wrote (the manifest, preallocated
      // records). Removed: a start that failed part-way (a tier that filled
      // up) left them, their space taken from a retry. By name only.
      for (size_t i = 0; i < config.subgroup_numel.size(); ++i) {
        unlink(absl::StrCat(tier.dir, "/sg_", i, ".state").c_str());
        unlink(absl::StrCat(tier.dir, "/sg_", i, ".grad").c_str());
      }
      unlink((tier.dir + "/MANIFEST").c_str());
      // Only our LOCK in it: nothing else was written there. The LOCK goes
      // while still held: a run of the same name that opened it meanwhile
      // is refused by its flock, or, taking it once it is dropped, finds it
      // gone from its path before its first commit (CheckStillAtPath); one
      // that comes after the rmdir makes the directory anew.
      bool only_lock = true;
      if (DIR* d = opendir(tier.dir.c_str())) {
        while (struct dirent* ent = readdir(d)) {
          const std::string name = ent->d_name;
          if (name != "." && name != ".." && name != "LOCK") only_lock = false;
        }
        closedir(d);
      } else {
        only_lock = false;
      }
      if (only_lock) unlink((tier.dir + "/LOCK").c_str());
    }
    // rmdir removes an empty directory only: one that holds anything (a
    // LOCK another process took, a record) stays. Best effort, and not
    // synced: a crash leaves an empty directory, as before this cleanup.
    rmdir(tier.dir.c_str());
    tier.run_lock.reset();
    tier.made_dir = false;
  }
}

absl::Status Engine::Impl::LoadCommitted() {
  // The manifest must describe this model; the commit records name slots.
  Manifest expected;
  expected.arrays_per_param = arrays();
  expected.subgroup_numel = numel;
  std::vector<std::string> dirs, texts;
  for (const auto& tier : tiers) dirs.push_back(tier.dir);
  MLP_ASSIGN_OR_RETURN(Manifest m, ReadRunManifest(dirs, expected, &texts));
  run_id = m.run_id;
  if (m.tier_of_subgroup != plan.tier_of_subgroup) {
    // The records stay where the run wrote them (placed under other
    // techniques or bandwidths): buffers, traffic and prediction follow.
    PlannerInput kept = planner_input;
    kept.placement = m.tier_of_subgroup;
    MLP_ASSIGN_OR_RETURN(plan, MakePlan(kept));
    plan.placement_kept = true;
  }
  std::vector<TierCommitFiles> commits;
  for (size_t t = 0; t < tiers.size(); ++t) {
    tiers[t].manifest = texts[t];
    MLP_ASSIGN_OR_RETURN(TierCommitFiles tc,
                         ReadTierCommitFiles(tiers[t].dir, n()));
    // Every tier's MANIFEST is the same; its COMMIT names the subgroups that
    // live on it, which tells a tier given in another position.
    for (int i = 0; i < n(); ++i) {
      const bool here = plan.tier_of_subgroup[i] == static_cast<int>(t);
      if ((tc.latest.record.subgroup_step[i] >= 0) != here) {
        return absl::FailedPreconditionError(absl::StrCat(
            tiers[t].dir, "/COMMIT",
            " is the commit record of another tier of the run than "
            "tier ",
            t, " (subgroup ", i, " is on tier ", plan.tier_of_subgroup[i],
            "): give the tiers the run used, in "
            "its order"));
      }
    }
    commits.push_back(std::move(tc));
  }
  {
    std::vector<CommitId> latest;
    for (const TierCommitFiles& c : commits)
      latest.push_back(c.latest.record.id);
    MLP_RETURN_IF_ERROR(CheckNoTierBehindTheMarks(dirs, latest));
  }
  // The newest commit every tier can give, or the one asked for. Commits
  // are matched by epoch and step: two commits of one step count (one
  // before, one after a load of an older checkpoint) are different states.
  CommitId want{config.resume_epoch, config.resume_step};
  if (config.resume_step < 0) {
    want = commits[0].latest.record.id;
    for (const TierCommitFiles& c : commits)
      want = std::min(want, c.latest.record.id);
  }
  commit_bytes.assign(tiers.size(), "");
  for (size_t t = 0; t < tiers.size(); ++t) {
    TierCommitFiles& tc = commits[t];
    const CommitFile* use = nullptr;
    if (tc.latest.record.id == want) {
      use = &tc.latest;
    } else if (tc.previous.has_value() && tc.previous->record.id == want) {
      use = &*tc.previous;
    } else {
      return absl::DataLossError(absl::StrCat(
          tiers[t].dir, " cannot give the commit of ", DescribeCommit(want),
          ": it has ", DescribeCommit(tc.latest.record.id),
          tc.previous.has_value()
              ? absl::StrCat(" and ", DescribeCommit(tc.previous->record.id))
              : std::string(tc.prev_status.ok()
                                ? " only"
                                : absl::StrCat(" only (COMMIT.prev: ",
                                               tc.prev_status.message(),
                                               ")"))));
    }
    const CommitRecord& c = use->record;
    for (int i = 0; i < n(); ++i) {
      if (plan.tier_of_subgroup[i] != static_cast<int>(t)) continue;
      current_slot[i] = committed_slot[i] = c.subgroup_slot[i];
      disk_step[i] = sg_step[i] = c.subgroup_step[i];
      disk_checksum[i] = c.subgroup_checksum[i];
      initialized[i] = true;
    }
    commit_bytes[t] = use->bytes;
  }
  // Rolled back tiers (all checked first): their COMMIT must not name slots
  // that this run will now rewrite. The marks go back first (durably): a
  // mark naming a newer commit than every tier's record would refuse the
  // next resume (CheckNoTierBehindTheMarks).
  if (auto newest = NewestCommittedMark(dirs);
      newest.has_value() && want < newest->first) {
    for (size_t t = 0; t < tiers.size(); ++t) {
      const std::string mark = tiers[t].dir + "/" + kCommittedMark;
      MLP_RETURN_IF_ERROR(
          Annotate(WriteFileAtomically(mark, EncodeCommittedMark(want)),
                   absl::StrCat("going back to the commit of ",
                                DescribeCommit(want), ": rewriting ", mark)));
    }
  }
  for (size_t t = 0; t < tiers.size(); ++t) {
    if (commits[t].latest.record.id != want) {
      MLP_RETURN_IF_ERROR(
          WriteFileAtomically(tiers[t].dir + "/COMMIT", commit_bytes[t]));
    }
  }
  commit_partial.assign(tiers.size(), false);
  committed = want;
  epoch = want.epoch;
  steps_done = want.step;
  // The commits every tier still holds: `want`, and the one before it where
  // every tier has it (a tier rolled back kept its COMMIT.prev).
  kept = {want};
  if (commits[0].previous.has_value()) {
    const CommitId older =
        std::min(commits[0].latest.record.id, commits[0].previous->record.id);
    bool everywhere = older < want;
    for (const TierCommitFiles& tc : commits) {
      everywhere =
          everywhere &&
          (tc.latest.record.id == older ||
           (tc.previous.has_value() && tc.previous->record.id == older));
    }
    if (everywhere) kept.push_back(older);
  }
  resumed = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CommitId>> ReadKeptCommits(
    const std::vector<std::string>& tier_dirs) {
  std::vector<CommitId> kept, latest;
  for (size_t t = 0; t < tier_dirs.size(); ++t) {
    MLP_ASSIGN_OR_RETURN(TierCommitFiles tc,
                         ReadTierCommitFiles(tier_dirs[t], -1));
    latest.push_back(tc.latest.record.id);
    std::vector<CommitId> held = {tc.latest.record.id};
    // A damaged COMMIT.prev holds nothing that a resume could use.
    if (tc.previous.has_value()) held.push_back(tc.previous->record.id);
    if (t == 0) {
      kept = held;
    } else {
      kept.erase(std::remove_if(kept.begin(), kept.end(),
                                [&held](const CommitId& id) {
                                  return std::find(held.begin(), held.end(),
                                                   id) == held.end();
                                }),
                 kept.end());
    }
  }
  MLP_RETURN_IF_ERROR(CheckNoTierBehindTheMarks(tier_dirs, latest));
  std::sort(kept.begin(), kept.end(),
            [](const CommitId& a, const CommitId& b) { return b < a; });
  kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
  return kept;
}

absl::Status CheckRunLayout(const std::vector<std::string>& tier_dirs,
                            int arrays_per_param,
                            const std::vector<uint64_t>& subgroup_numel) {
  Manifest expected;
  expected.arrays_per_param = arrays_per_param;
  expected.subgroup_numel = subgroup_numel;
  std::vector<std::string> texts;
  return ReadRunManifest(tier_dirs, expected, &texts).status();
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (impl_ == nullptr) return;
  {
    MutexLock l(&impl_->mu);
    (void)impl_->DrainWrites();
  }
  impl_->tiers.clear();  // channels drain and shut their engines down
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const EngineConfig& config) {
  if (config.num_state_arrays < 0 || config.num_state_arrays > 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_state_arrays must be in [0, 8], got ", config.num_state_arrays));
  }
  if (config.run_name.empty() ||
      config.run_name.find('/') != std::string::npos ||
      config.run_name == "." || config.run_name == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat("run_name must be a plain directory name, got '",
                     config.run_name, "'"));
  }
  if (config.commit_every < 0) {
    return absl::InvalidArgumentError("commit_every must be >= 0");
  }
  if (config.compute_threads < 1 ||
      config.compute_threads > kMaxComputeThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute_threads must be in [1, ", kMaxComputeThreads,
                     "], got ", config.compute_threads));
  }
  if (config.tier_lock_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier_lock_timeout must be > 0 (InfiniteDuration: no "
                     "limit), got ",
                     absl::FormatDuration(config.tier_lock_timeout)));
  }
  auto impl = std::make_unique<Impl>(config);
  MLP_RETURN_IF_ERROR(impl->pool.start_status());
  PlannerInput in;
  in.subgroup_numel = config.subgroup_numel;
  in.arrays_per_param = 1 + config.num_state_arrays;
  in.grad_bytes = static_cast<int>(DTypeSize(config.grad_dtype));
  in.tiers = config.tiers;
  for (TierSpec& t : in.tiers) {
    // Unknown bandwidths: treat the tiers as equal (the CLI's probe measures).
    if (t.read_bytes_per_sec <= 0 && t.throttle_read_bytes_per_sec <= 0)
      t.read_bytes_per_sec = 1e9;
    if (t.write_bytes_per_sec <= 0 && t.throttle_write_bytes_per_sec <= 0)
      t.write_bytes_per_sec = 1e9;
  }
  in.host_budget_bytes = config.host_budget_bytes;
  in.techniques = config.techniques;
  Impl& e = *impl;
  const int n = static_cast<int>(config.subgroup_numel.size());
  // Check the tiers before planning so a bad path is named as such, and
  // plan before creating anything, so a refused config leaves no trace.
  MLP_RETURN_IF_ERROR(e.CheckTiers());
  // Capacity, unless given: this process's share of what the file system
  // has free (the node's shared_by processes that use the tier plan at the
  // same time, each against the same free space, and so do the tiers of
  // this run on that file system: before, each was credited with all of
  // it, and the start failed part-way, at a record's fallocate), plus what
  // this run's state files there hold already (a resume rewrites them in
  // place; without them, a run that takes more than half the free space
  // could never be resumed). Unknown: unlimited.
  std::map<dev_t, int> tiers_on_device;
  std::vector<std::optional<dev_t>> device(in.tiers.size());
  for (size_t t = 0; t < in.tiers.size(); ++t) {
    struct stat st;
    if (in.tiers[t].capacity_bytes == 0 &&
        stat(e.real_paths[t].c_str(), &st) == 0) {
      device[t] = st.st_dev;
      ++tiers_on_device[st.st_dev];
    }
  }
  std::vector<std::string> capacity_from;  // for a plan that does not fit
  for (size_t t = 0; t < in.tiers.size(); ++t) {
    if (in.tiers[t].capacity_bytes != 0) continue;
    const std::optional<uint64_t> free = TierFreeBytes(in.tiers[t].path);
    if (!free.has_value()) continue;
    const uint64_t own =
        ExistingRunBytes(absl::StrCat(e.real_paths[t], "/", config.run_name),
                         config.subgroup_numel, 1 + config.num_state_arrays,
                         !config.techniques.delayed_grad_conversion);
    const int processes = std::max(1, in.tiers[t].shared_by);
    const int same_fs = device[t].has_value() ? tiers_on_device[*device[t]] : 1;
    const uint64_t share = *free / static_cast<uint64_t>(processes) /
                           static_cast<uint64_t>(same_fs);
    // A full tier holds nothing (0 would tell the planner "unlimited").
    in.tiers[t].capacity_bytes = std::max<uint64_t>(1, share + own);
    capacity_from.push_back(absl::StrCat(
        "tier ", t, " (", in.tiers[t].path, ") ",
        HumanBytes(in.tiers[t].capacity_bytes), ": ", HumanBytes(*free),
        " free",
        processes > 1 ? absl::StrCat(" / ", processes,
                                     " processes of the node (shared_by)")
                      : "",
        same_fs > 1 ? absl::StrCat(" / ", same_fs, " tiers on that file system")
                    : "",
        own > 0 ? absl::StrCat(" + ", HumanBytes(own),
                               " held by the run's files there")
                : ""));
  }
  absl::StatusOr<Plan> planned = MakePlan(in);
  if (!planned.ok() &&
      planned.status().code() == absl::StatusCode::kResourceExhausted &&
      absl::StrContains(planned.status().message(), "on disk") &&
      !capacity_from.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        planned.status().message(), "; capacities from the free space: ",
        absl::StrJoin(capacity_from, ", "),
        " (give capacity_bytes to set them)"));
  }
  MLP_RETURN_IF_ERROR(planned.status());
  e.plan = *std::move(planned);
  e.planner_input = std::move(in);
  // From here on the run directories exist: a failed Create removes the
  // ones it made and left empty (a private run's, whose name no later run
  // takes up, would stay behind otherwise). Destroyed before `impl`.
  struct RemoveMadeRunDirsOnError {
    Impl* impl;
    ~RemoveMadeRunDirsOnError() {
      if (impl != nullptr) impl->RemoveMadeRunDirs();
    }
  } remove_made_dirs{&e};
  MLP_RETURN_IF_ERROR(e.OpenTiers());
  e.numel = config.subgroup_numel;
  e.payload_bytes.resize(n);
  e.record_bytes.resize(n);
  for (int i = 0; i < n; ++i) {
    e.payload_bytes[i] = e.numel[i] * 4ull * e.arrays();
    e.record_bytes[i] = RoundUp(e.payload_bytes[i]);
  }
  e.current_slot.assign(n, -1);
  e.committed_slot.assign(n, -1);
  e.disk_step.assign(n, 0);
  e.disk_checksum.assign(n, 0);
  e.rewritten.assign(n, false);
  e.sync_lost.assign(n, false);
  e.sg_step.assign(n, 0);
  e.initialized.assign(n, false);
  e.grad_nonfinite.assign(n, false);
  e.grad_offloaded.assign(n, false);
  e.done_in_step.assign(n, false);
  e.untouched_in_step.assign(n, Impl::kUpdated);

  if (config.resume) {
    MLP_RETURN_IF_ERROR(e.LoadCommitted());
  } else {
    std::random_device rd;
    e.run_id = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
               static_cast<uint64_t>(getpid());
    Manifest m;
    m.run_id = e.run_id;
    m.arrays_per_param = e.arrays();
    m.subgroup_numel = e.numel;
    m.tier_of_subgroup = e.plan.tier_of_subgroup;
    // An old run's kCommittedMark must not be taken for this one's: every
    // tier's goes before any commit record (a crash in between leaves an
    // old commit on every tier, which a resume takes up).
    for (const auto& tier : e.tiers) {
      const std::string mark = tier.dir + "/" + kCommittedMark;
      if (unlink(mark.c_str()) != 0) {
        if (errno != ENOENT) {
          return ErrnoStatus(errno, "removing an earlier run's mark", mark);
        }
        continue;
      }
      MLP_RETURN_IF_ERROR(SyncDirectory(tier.dir));
    }
    for (size_t t = 0; t < e.tiers.size(); ++t) {
      auto& tier = e.tiers[t];
      // A fresh run: an old commit record must not be resumed against it.
      unlink((tier.dir + "/COMMIT").c_str());
      unlink((tier.dir + "/COMMIT.prev").c_str());
      tier.manifest = EncodeManifest(m);
      MLP_RETURN_IF_ERROR(
          WriteFileAtomically(tier.dir + "/MANIFEST", tier.manifest));
      // After the commit records: a crash in between leaves no commit that
      // names a removed record.
      MLP_RETURN_IF_ERROR(
          Annotate(RemoveStaleRecords(tier.dir, static_cast<int>(t),
                                      e.plan.tier_of_subgroup, e.eager_grads()),
                   absl::StrCat("tier ", t)));
    }
  }

  e.state_files.resize(n);
  if (e.eager_grads()) e.grad_files.resize(n);
  for (int i = 0; i < n; ++i) {
    const std::string& dir = e.tiers[e.plan.tier_of_subgroup[i]].dir;
    FileOptions fo;
    fo.create = true;
    fo.preallocate_bytes = config.resume ? 0 : 2 * e.slot_bytes(i);
    MLP_ASSIGN_OR_RETURN(
        e.state_files[i],
        File::Open(absl::StrCat(dir, "/sg_", i, ".state"), fo));
    if (e.eager_grads()) {
      fo.preallocate_bytes = RoundUp(e.numel[i] * 4);
      MLP_ASSIGN_OR_RETURN(
          e.grad_files[i],
          File::Open(absl::StrCat(dir, "/sg_", i, ".grad"), fo));
    }
  }

  e.ResetStats();
  const int num_buffers = e.plan.num_buffers + e.plan.num_cached;
  {
    MutexLock l(&e.mu);
    e.buffers.resize(num_buffers);
    e.buffer_of.assign(n, -1);
    e.grad_writes_of.assign(n, 0);
    for (int b = 0; b < num_buffers; ++b) {
      MLP_ASSIGN_OR_RETURN(e.buffers[b].mem,
                           AlignedBuffer::Allocate(e.plan.buffer_bytes));
    }
  }
  remove_made_dirs.impl = nullptr;  // the run's now, kept
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

const Plan& Engine::plan() const { return impl_->plan; }
const EngineConfig& Engine::config() const { return impl_->config; }
int Engine::num_subgroups() const { return impl_->n(); }
int64_t Engine::step() const { return impl_->steps_done; }

absl::Status Engine::SetStep(int64_t step) {
  Impl& e = *impl_;
  MutexLock l(&e.mu);
  if (e.in_step || e.step_failed) {
    return absl::FailedPreconditionError(
        "SetStep: a step is in progress or failed part-way");
  }
  for (int i = 0; i < e.n(); ++i) {
    if (e.sg_step[i] > step) {
      return absl::InvalidArgumentError(
          absl::StrCat("SetStep(", step, "): subgroup ", i, " has taken ",
                       e.sg_step[i], " steps"));
    }
  }
  e.steps_done = step;
  return absl::OkStatus();
}

absl::Status Engine::Commit() {
  Impl& e = *impl_;
  if (e.in_step) return absl::FailedPreconditionError("Commit during a step");
  if (e.step_failed) {
    return absl::FailedPreconditionError(
        "Commit: a step that failed part-way is pending (retry it first)");
  }
  if (e.config.commit_every <= 0) {
    return absl::FailedPreconditionError(
        "Commit: the run does not commit (commit_every is 0)");
  }
  for (int i = 0; i < e.n(); ++i) {
    if (!e.initialized[i]) {
      return absl::FailedPreconditionError(
          absl::StrCat("Commit: subgroup ", i, " was never initialised"));
    }
  }
  MutexLock l(&e.mu);
  if (e.committed == CommitId{e.epoch, e.steps_done}) {
    // One commit, one state: nothing to write if nothing changed since.
    bool changed = false;
    for (int i = 0; i < e.n(); ++i) {
      changed = changed || e.current_slot[i] != e.committed_slot[i] ||
                e.disk_step[i] != e.sg_step[i] || e.rewritten[i];
    }
    if (!changed) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "Commit: ", DescribeCommit(e.committed),
        " is committed already and the state changed since: SetEpoch to a "
        "later epoch first"));
  }
  MLP_RETURN_IF_ERROR(e.FlushCached());
  return Annotate(e.WriteCommit(),
                  absl::StrCat("commit of step ", e.steps_done));
}

absl::Status Engine::RetryCommit() {
  Impl& e = *impl_;
  if (e.in_step) return absl::FailedPreconditionError("RetryCommit in a step");
  if (!e.failed_commit.has_value() ||
      *e.failed_commit != CommitId{e.epoch, e.steps_done}) {
    return absl::OkStatus();  // none failed, or the state moved on since
  }
  if (e.step_failed) {
    return absl::FailedPreconditionError(
        "RetryCommit: a step that failed part-way is pending (retry it "
        "first)");
  }
  MutexLock l(&e.mu);
  MLP_RETURN_IF_ERROR(e.FlushCached());
  return Annotate(e.WriteCommit(),
                  absl::StrCat("commit of step ", e.steps_done));
}
bool Engine::step_incomplete() const { return impl_->step_failed; }
bool Engine::resumed() const { return impl_->resumed; }
int64_t Engine::committed_step() const { return impl_->committed.step; }
int64_t Engine::committed_epoch() const { return impl_->committed.epoch; }
absl::Status Engine::commit_mark_error() const { return impl_->mark_error; }
int64_t Engine::epoch() const { return impl_->epoch; }
const std::vector<CommitId>& Engine::kept_commits() const {
  return impl_->kept;
}

absl::Status Engine::SetEpoch(int64_t epoch) {
  Impl& e = *impl_;
  if (e.in_step) return absl::FailedPreconditionError("SetEpoch during a step");
  if (epoch < e.epoch) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetEpoch(", epoch, "): the engine is at epoch ", e.epoch,
                     " already (epochs only go forward)"));
  }
  e.epoch = epoch;
  return absl::OkStatus();
}
FaultInjectingEngine* Engine::fault_injector(int tier) const {
  if (tier < 0 || tier >= static_cast<int>(impl_->tiers.size())) return nullptr;
  return impl_->tiers[tier].faults;
}

absl::Status Engine::InitializeSubgroup(int i, const void* params, DType dtype,
                                        const OptimizerHyperparams* state_init,
                                        bool commit_initial) {
  return InitializeSubgroups({{i, params, state_init}}, dtype, commit_initial);
}

absl::Status Engine::InitializeSubgroups(const std::vector<SubgroupInit>& inits,
                                         DType dtype, bool commit_initial) {
  Impl& e = *impl_;
  std::vector<int> which, init_of;
  for (const SubgroupInit& in : inits) which.push_back(in.subgroup);
  MLP_RETURN_IF_ERROR(e.IndexBatch("InitializeSubgroups", which, &init_of));
  for (const SubgroupInit& in : inits) {
    if (in.params == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "InitializeSubgroups: null params for subgroup ", in.subgroup));
    }
  }
  MutexLock l(&e.mu);
  MLP_RETURN_IF_ERROR(e.WriteRecords(
      which, "initialising", /*write_cached=*/true, [&](int i, float* payload) {
        const SubgroupInit& in = inits[init_of[i]];
        const uint64_t n = e.numel[i];
        ConvertToFloat32(in.params, dtype, payload, n, &e.pool);
        float* state[3] = {nullptr, nullptr, nullptr};
        for (int k = 0; k < e.config.num_state_arrays; ++k) {
          float* s = payload + (k + 1) * n;
          if (k < 3) state[k] = s;
          std::memset(s, 0, n * sizeof(float));
        }
        if (in.state_init != nullptr && e.config.num_state_arrays <= 3) {
          InitState(*in.state_init, state, n, &e.pool);
        }
        return int64_t{0};
      }));
  if (commit_initial && e.config.commit_every > 0 && e.committed.step < 0 &&
      std::all_of(e.initialized.begin(), e.initialized.end(),
                  [](bool x) { return x; })) {
    // The initial state is resumable too (records another call left in
    // memory go to disk first).
    absl::Status s = e.FlushCached();
    if (s.ok()) s = e.WriteCommit();
    return s;
  }
  return absl::OkStatus();
}

namespace {

// A step's gradient scale, checked before the step changes anything (the
// kernels check it too, but only once the step has begun).
absl::Status CheckGradScale(float grad_scale) {
  if (std::isfinite(grad_scale)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("grad_scale must be finite, got ", grad_scale));
}

// OK if `segments` cover the `numel` elements of subgroup `i` once each
// (in any order, without overlaps or gaps), with gradients where
// `need_grads`; `what` names the caller in the error.
absl::Status CheckSegments(const char* what, int i, uint64_t numel,
                           const std::vector<Segment>& segments,
                           bool need_grads = true) {
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // (offset, numel)
  spans.reserve(segments.size());
  for (const Segment& s : segments) {
    // Written so that no sum can wrap around.
    if ((need_grads && s.grad == nullptr) || s.offset > numel ||
        s.numel > numel - s.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": bad segment for subgroup ", i, " (offset ", s.offset,
          ", numel ", s.numel, ", subgroup size ", numel, ")"));
    }
    spans.emplace_back(s.offset, s.numel);
  }
  std::sort(spans.begin(), spans.end());
  uint64_t covered = 0;  // [0, covered) is covered once
  for (const auto& [offset, n] : spans) {
    if (offset != covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": segments of subgroup ", i,
                       offset < covered ? " overlap at element "
                                        : " leave a gap at element ",
                       std::min(offset, covered)));
    }
    covered += n;
  }
  if (covered != numel) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": segments cover ",
                                                   covered, " of subgroup ", i,
                                                   "'s ", numel, " elements"));
  }
  return absl::OkStatus();
}

// A subgroup's gradient fingerprint from its segments' (offset, checksum),
// in subgroup order.
uint64_t CombineSegmentHashes(
    std::vector<std::pair<uint64_t, uint64_t>> hashes) {
  std::sort(hashes.begin(), hashes.end());
  std::vector<uint64_t> parts;
  parts.reserve(2 * hashes.size());
  for (const auto& [offset, hash] : hashes) {
    parts.push_back(offset);
    parts.push_back(hash);
  }
  return PayloadChecksum(parts.data(), parts.size() * sizeof(uint64_t), nullptr,
                         kStateFormatVersion);
}

}  // namespace

absl::StatusOr<uint64_t> Engine::GradientFingerprint(
    int i, const std::vector<Segment>& segments) {
  Impl& e = *impl_;
  if (i < 0 || i >= e.n())
    return absl::OutOfRangeError(absl::StrCat("no subgroup ", i));
  MLP_RETURN_IF_ERROR(
      CheckSegments("GradientFingerprint", i, e.numel[i], segments));
  std::vector<const Segment*> order;
  order.reserve(segments.size());
  for (const Segment& s : segments) order.push_back(&s);
  std::sort(order.begin(), order.end(), [](const Segment* a, const Segment* b) {
    return a->offset < b->offset;
  });
  const size_t bytes = DTypeSize(e.config.grad_dtype);
  std::vector<std::pair<uint64_t, uint64_t>> hashes;
  hashes.reserve(order.size());
  for (const Segment* s : order) {
    hashes.push_back(
        {s->offset, PayloadChecksum(s->grad, s->numel * bytes, &e.pool,
                                    kStateFormatVersion)});
  }
  return CombineSegmentHashes(std::move(hashes));
}

absl::Status Engine::OffloadGradients(int i,
                                      const std::vector<Segment>& segments,
                                      uint64_t* fingerprint) {
  Impl& e = *impl_;
  if (i < 0 || i >= e.n())
    return absl::OutOfRangeError(absl::StrCat("no subgroup ", i));
  if (e.in_step) {
    return absl::FailedPreconditionError(
        "OffloadGradients during a step (offload before BeginStep)");
  }
  MLP_RETURN_IF_ERROR(
      CheckSegments("OffloadGradients", i, e.numel[i], segments));
  if (!e.eager_grads()) {  // delayed: the gradient stays where it is
    if (fingerprint == nullptr) return absl::OkStatus();
    MLP_ASSIGN_OR_RETURN(*fingerprint, GradientFingerprint(i, segments));
    return absl::OkStatus();
  }
  MonoTime start = MonoNow();
  // The baseline converts to fp32 at once and swaps the result out, as
  // ZeRO-Infinity does during backward: the write is asynchronous (the next
  // Step waits for it), the conversion is not.
  // The grad area of the subgroup's own buffer if it is cached, else of a
  // scratch buffer (claimed without binding it to the subgroup).
  int b;
  {
    MutexLock l(&e.mu);
    // An earlier offload of this gradient still being written (from another
    // buffer) must land first: two writes of one file in flight may land in
    // either order, and the last offload is the one that counts.
    auto earlier_landed = [&e, i]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu) {
      return e.grad_writes_of[i] == 0;
    };
    e.mu.Await(earlier_landed);
    b = e.buffer_of[i];
    if (b < 0) {
      MLP_ASSIGN_OR_RETURN(b, e.WaitAndClaimFree(-1, BufState::kInUse));
      e.buffers[b].scratch = true;
    } else {
      MLP_RETURN_IF_ERROR(e.WaitIo(b));
    }
    e.buffers[b].grad_write = true;
    e.buffers[b].grad_subgroup = i;
    ++e.grad_writes;
    ++e.grad_writes_of[i];
  }
  float* g32 = reinterpret_cast<float*>(
      reinterpret_cast<char*>(e.PayloadUnlocked(b)) + e.record_bytes[i]);
  // One pass over the gradients: each 1 MiB chunk converted, checked and
  // (for the fingerprint) hashed while it is in cache.
  const DType dtype = e.config.grad_dtype;
  const size_t bytes = DTypeSize(dtype);
  std::atomic<bool> nonfinite{false};
  std::vector<std::pair<uint64_t, uint64_t>> hashes;
  for (const Segment& s : segments) {
    float* const out = g32 + s.offset;
    auto convert = [&](size_t begin, size_t length) {
      const size_t first = begin / bytes, n = length / bytes;
      ConvertToFloat32(static_cast<const char*>(s.grad) + begin, dtype,
                       out + first, n, nullptr);
      if (AnyNonfinite(out + first, DType::kFloat32, n, 1.0f, nullptr)) {
        nonfinite.store(true, std::memory_order_relaxed);
      }
    };
    if (fingerprint != nullptr) {
      hashes.push_back(
          {s.offset, PayloadChecksumVisiting(s.grad, s.numel * bytes, &e.pool,
                                             convert, kStateFormatVersion)});
    } else {
      // The same chunks, without the hash.
      const size_t total = s.numel * bytes, chunk = kChecksumChunkBytes;
      e.pool.ParallelFor((total + chunk - 1) / chunk, [&](size_t c) {
        convert(c * chunk, std::min(chunk, total - c * chunk));
      });
    }
  }
  if (fingerprint != nullptr) *fingerprint = CombineSegmentHashes(hashes);
  const int t = e.plan.tier_of_subgroup[i];
  IoRequest req;
  req.op = IoOp::kWrite;
  req.file = e.grad_files[i].get();
  req.offset = 0;
  req.length = RoundUp(e.numel[i] * 4);
  req.buffer = g32;
  MutexLock l(&e.mu);
  ++e.buffers[b].pending;
  uint64_t len = req.length;
  e.tiers[t].channel->Submit(req, [&e, b, len, t](absl::StatusOr<size_t> r) {
    e.OnIoDone(b, len, t, false, std::move(r));
  });
  e.grad_nonfinite[i] = nonfinite.load();
  e.grad_offloaded[i] = true;
  e.stats.grad_offload_seconds += SecondsSince(start);
  return absl::OkStatus();
}

absl::Status Engine::BeginStep(const std::vector<bool>& skip) {
  Impl& e = *impl_;
  if (e.in_step)
    return absl::FailedPreconditionError(
        "BeginStep: a step is already running");
  if (!skip.empty() && static_cast<int>(skip.size()) != e.n()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BeginStep: ", skip.size(), " skip flags for ", e.n(), " subgroups"));
  }
  for (int i = 0; i < e.n(); ++i) {
    if (!e.initialized[i]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "subgroup ", i, " was never initialised (InitializeSubgroup)"));
    }
  }
  if (e.config.commit_every > 0 &&
      (e.steps_done + 1) % e.config.commit_every == 0) {
    // Refused before anything changes: the step's commit would be refused.
    MLP_RETURN_IF_ERROR(Annotate(
        e.CheckNewerThanCommitted({e.epoch, e.steps_done + 1}), "BeginStep"));
  }
  if (!e.step_failed) {
    // A commit that failed after its step (a full tier, a failed fsync) is
    // written before this step overwrites the slots it names: a failure
    // after its COMMIT was renamed into place leaves that record on disk,
    // naming the slots the step would write (the last whole commit's are
    // the others). Refused, changing nothing, if it fails again.
    MLP_RETURN_IF_ERROR(RetryCommit());
  }
  MutexLock l(&e.mu);
  // The baseline's gradient writes must have landed before they are read.
  MonoTime grad_wait = MonoNow();
  auto grads_landed = [&e]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu) {
    return e.grad_writes == 0;
  };
  e.mu.Await(grads_landed);
  const double waited = SecondsSince(grad_wait);
  e.stats.grad_offload_seconds += waited;
  e.stats.grad_wait_seconds += waited;
  if (!e.grad_error.ok()) {
    absl::Status s = e.grad_error;
    e.grad_error = absl::OkStatus();
    e.ClearOffloadedGradients();
    return Annotate(s,
                    "baseline gradient offload (offload the gradients again)");
  }
  if (e.step_failed) {
    // Retrying a step that failed part-way: records it already updated are
    // not updated again; write back the ones held in memory (failed writes)
    // so the buffers are free for streaming. One whose write landed (a kept
    // record's commit write) is on its tier already: written again, a write
    // that failed part-way would tear the slot that holds it, while the
    // engine still counted it there.
    for (size_t b = 0; b < e.buffers.size(); ++b) {
      int i = e.buffers[b].subgroup;
      if (e.buffers[b].state == BufState::kCached && i >= 0 &&
          e.done_in_step[i]) {
        if (!e.OnDisk(i)) {
          MLP_RETURN_IF_ERROR(e.WriteNow(i, static_cast<int>(b)));
        }
        e.Free(static_cast<int>(b));
      }
    }
  }
  // An error of I/O outside a step (a failed ReadSubgroup or checkpoint
  // read, which its caller got) is not this step's.
  e.step_error = absl::OkStatus();
  e.in_step = true;
  e.order = e.plan.Order(e.steps_done);
  e.pos = 0;
  e.next_read = 0;
  e.stats.step = e.steps_done + 1;
  e.step_start = MonoNow();
  e.peak_in_use = e.buffers_in_use;
  // Records without a gradient stay where they are if their tier holds
  // their latest version. A resident one goes through the step as before
  // (so the cache keeps the plan's shape), and so does one whose latest
  // version was lost (a failed load freed it): its read reports the loss
  // before anything is updated or committed.
  for (int i = 0; i < static_cast<int>(skip.size()); ++i) {
    if (skip[i] && !e.done_in_step[i] && e.buffer_of[i] < 0 && e.OnDisk(i)) {
      e.done_in_step[i] = true;
      e.untouched_in_step[i] = Impl::kLeftOnTier;
      ++e.stats.subgroups_left_on_tier;
    }
  }
  e.IssueReads();
  return absl::OkStatus();
}

bool Engine::NextIsReady() {
  Impl& e = *impl_;
  if (!e.in_step) return true;
  MutexLock l(&e.mu);
  const size_t pos = e.NextPos();
  if (pos >= e.order.size()) return true;
  const int b = e.buffer_of[e.order[pos]];
  return b >= 0 && e.buffers[b].pending == 0;
}

absl::StatusOr<SubgroupView> Engine::Next() {
  Impl& e = *impl_;
  if (!e.in_step)
    return absl::FailedPreconditionError("Next: no step running (BeginStep)");
  if (e.interrupted.load()) {
    return absl::CancelledError(absl::StrCat(
        "step ", e.steps_done + 1,
        " interrupted: the subgroups finished keep their update and the "
        "next step resumes the others"));
  }
  MutexLock l(&e.mu);
  e.pos = e.NextPos();
  if (e.pos >= e.order.size()) return SubgroupView{};
  const int i = e.order[e.pos];
  e.IssueReads();
  MonoTime wait_start = MonoNow();
  int b = e.buffer_of[i];
  // A cache hit: the record in memory may be the only copy of its latest
  // version (kept after the last step's update, never written), so a failed
  // read (the baseline's gradient) must not drop it.
  const bool hit = b >= 0 && e.buffers[b].state == BufState::kCached;
  if (b < 0) {
    // Not yet issued (all buffers were busy): wait for one, then read.
    auto claimed = e.WaitAndClaimFree(i, BufState::kReading);
    if (!claimed.ok()) {
      return Annotate(claimed.status(),
                      absl::StrCat("step ", e.steps_done + 1));
    }
    b = *claimed;
    e.IssueRead(i, b);
    e.next_read = std::max(e.next_read, e.pos + 1);
  }
  absl::Status s = e.WaitIo(b);
  const double hashed_before = e.stats.checksum_seconds;
  if (s.ok()) s = e.VerifyRecord(i, b);
  // The verification's hashing is checksum_seconds'.
  e.stats.read_wait_seconds +=
      std::max(0.0, SecondsSince(wait_start) -
                        (e.stats.checksum_seconds - hashed_before));
  if (!s.ok()) {
    if (hit) {
      e.buffers[b].io_status = absl::OkStatus();  // the retry reads again
    } else {
      e.Free(b);
    }
    return Annotate(s, absl::StrCat("step ", e.steps_done + 1, ", subgroup ", i,
                                    ", tier ", e.plan.tier_of_subgroup[i]));
  }
  e.buffers[b].state = BufState::kInUse;
  SubgroupView v;
  v.subgroup = i;
  v.numel = e.numel[i];
  v.master = e.Payload(b);
  for (int k = 0; k < e.config.num_state_arrays; ++k) {
    v.state.push_back(v.master + (k + 1) * e.numel[i]);
  }
  if (e.eager_grads()) v.grad32 = e.GradArea(b, i);
  v.step = e.sg_step[i];
  return v;
}

absl::Status Engine::Done(bool updated) {
  Impl& e = *impl_;
  if (!e.in_step || e.pos >= e.order.size()) {
    return absl::FailedPreconditionError("Done: no subgroup is being updated");
  }
  const int i = e.order[e.pos];
  const bool commit = e.config.commit_every > 0 &&
                      (e.steps_done + 1) % e.config.commit_every == 0;
  const bool kept =
      e.plan.KeptAfterUpdate(e.steps_done, static_cast<int>(e.pos));
  // The record is this thread's until the write is issued: checksum it
  // before taking the lock.
  uint64_t checksum = 0;
  int b;
  bool unchanged_on_disk;  // nothing to write
  {
    MutexLock l(&e.mu);
    b = e.buffer_of[i];
    // Only the record Next handed out: another may still be being read
    // into, or have no buffer yet.
    if (b < 0 || e.buffers[b].state != BufState::kInUse) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Done: subgroup ", i,
          " was not handed out by Next (call Next before each Done)"));
    }
    unchanged_on_disk = !updated && e.OnDisk(i);
  }
  double hashed = 0;
  if ((!kept || commit) && !unchanged_on_disk) {
    const MonoTime hash_start = MonoNow();
    checksum = PayloadChecksum(e.PayloadUnlocked(b), e.payload_bytes[i],
                               &e.pool, kStateFormatVersion);
    hashed = SecondsSince(hash_start);
  }
  MutexLock l(&e.mu);
  e.stats.checksum_seconds += hashed;
  if (updated) ++e.sg_step[i];
  e.done_in_step[i] = true;
  if (!updated) e.untouched_in_step[i] = Impl::kPassedThrough;
  if (kept) {
    e.buffers[b].state = BufState::kCached;
    // Durable too, and still cached.
    if (commit && !unchanged_on_disk) {
      e.IssueWrite(i, b, checksum, kStateFormatVersion);
    }
  } else if (unchanged_on_disk) {
    e.Free(b);
  } else {
    e.buffers[b].state = BufState::kWriting;
    e.IssueWrite(i, b, checksum, kStateFormatVersion);
  }
  ++e.pos;
  e.IssueReads();
  return absl::OkStatus();
}

absl::StatusOr<StepStats> Engine::EndStep() {
  Impl& e = *impl_;
  if (!e.in_step)
    return absl::FailedPreconditionError("EndStep: no step running");
  MonoTime wait_start = MonoNow();
  absl::Status s;
  {
    MutexLock l(&e.mu);
    s = e.DrainWrites();
    e.stats.write_wait_seconds += SecondsSince(wait_start);
    e.stats.peak_host_bytes =
        static_cast<uint64_t>(e.peak_in_use) * e.plan.buffer_bytes;
  }
  // A failure ends the step as AbortStep does (called before every record
  // was handed back, reads ahead are still claimed and maybe in flight).
  if (!s.ok()) {
    AbortStep();
    return Annotate(s, absl::StrCat("step ", e.steps_done + 1));
  }
  for (int i = 0; i < e.n(); ++i) {
    if (!e.done_in_step[i]) {
      AbortStep();
      return absl::FailedPreconditionError(
          absl::StrCat("EndStep: subgroup ", i, " was not updated"));
    }
  }
  ++e.steps_done;
  e.in_step = false;
  e.step_failed = false;
  std::fill(e.done_in_step.begin(), e.done_in_step.end(), false);
  std::fill(e.untouched_in_step.begin(), e.untouched_in_step.end(),
            Impl::kUpdated);
  e.ClearOffloadedGradients();
  if (e.config.commit_every > 0 && e.steps_done % e.config.commit_every == 0) {
    MutexLock l(&e.mu);
    const absl::Status committed = e.WriteCommit();
    if (!committed.ok()) {
      e.ResetStats();  // the step is done: its counts are not the next one's
      return committed;
    }
  }
  e.stats.seconds = SecondsSince(e.step_start) + e.stats.grad_offload_seconds;
  StepStats out = e.stats;
  e.ResetStats();
  return out;
}

void Engine::SetInterrupted(bool interrupted) {
  Impl& e = *impl_;
  e.interrupted.store(interrupted);
  e.SetIoInterrupted(interrupted);
}

void Engine::AbortStep() {
  Impl& e = *impl_;
  if (!e.in_step) return;
  // What a tier's cap or lock holds back is not waited for: the reads ahead
  // are dropped anyway, and a write that does not land leaves its record
  // cached (DrainWrites). (Not under mu: the dropped requests complete on
  // this thread.)
  e.SetIoInterrupted(true);
  {
    MutexLock l(&e.mu);
    (void)e.DrainWrites();
    // Reads in flight or done for records not yet updated: drop them.
    for (size_t b = 0; b < e.buffers.size(); ++b) {
      Buffer& buf = e.buffers[b];
      if (buf.state == BufState::kReading || buf.state == BufState::kReady) {
        (void)e.WaitIo(static_cast<int>(b));
        e.Free(static_cast<int>(b));
      } else if (buf.state == BufState::kInUse) {
        // Being updated when the step failed: keep it as the latest version.
        buf.state = BufState::kCached;
      }
    }
    e.StepFailed();
  }
  e.SetIoInterrupted(e.interrupted.load());
}

absl::Status Engine::Impl::ValidateStepInputs(
    const std::vector<SubgroupStepInput>& inputs) const {
  const Impl& e = *this;
  if (static_cast<int>(inputs.size()) != e.n()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Step: ", inputs.size(), " inputs for ", e.n(), " subgroups"));
  }
  const int s_arrays = e.config.num_state_arrays;
  for (int i = 0; i < e.n(); ++i) {
    const SubgroupStepInput& in = inputs[i];
    if (NumStateArrays(in.hp) > s_arrays) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Step: subgroup ", i, "'s optimizer keeps ", NumStateArrays(in.hp),
          " state arrays, the engine was created for ", s_arrays));
    }
    if (in.skip) continue;
    if (e.eager_grads() && !e.grad_offloaded[i] && !e.done_in_step[i]) {
      return absl::FailedPreconditionError(
          absl::StrCat("baseline mode: the gradient of subgroup ", i,
                       " was not offloaded (OffloadGradients)"));
    }
    OptimizerHyperparams check = in.hp;
    check.step = 1;
    MLP_RETURN_IF_ERROR(
        Annotate(ValidateHyperparams(check), absl::StrCat("subgroup ", i)));
    MLP_RETURN_IF_ERROR(CheckSegments("Step", i, e.numel[i], in.segments,
                                      /*need_grads=*/!e.eager_grads()));
  }
  return absl::OkStatus();
}

bool Engine::Impl::AnyGradientNonfinite(
    const std::vector<SubgroupStepInput>& inputs, float grad_scale) {
  Impl& e = *this;
  for (int i = 0; i < e.n(); ++i) {
    // A subgroup without a gradient this step has none to check (in the
    // baseline, its flag is an earlier step's).
    if (inputs[i].skip) continue;
    if (e.eager_grads()) {
      if (e.grad_offloaded[i] && e.grad_nonfinite[i]) return true;
      continue;
    }
    for (const Segment& seg : inputs[i].segments) {
      if (AnyNonfinite(seg.grad, e.config.grad_dtype, seg.numel, grad_scale,
                       &e.pool)) {
        return true;
      }
    }
  }
  return false;
}

absl::StatusOr<bool> Engine::GradientsNonfinite(
    const std::vector<SubgroupStepInput>& inputs, float grad_scale) {
  MLP_RETURN_IF_ERROR(impl_->ValidateStepInputs(inputs));
  MLP_RETURN_IF_ERROR(CheckGradScale(grad_scale));
  return impl_->AnyGradientNonfinite(inputs, grad_scale);
}

StepStats Engine::SkipStep() {
  Impl& e = *impl_;
  MutexLock l(&e.mu);
  // The skipped step's gradient writes (the baseline's) land first: the
  // I/O threads count their bytes into the stats copied and reset here,
  // and they count in this step's, not the next one's.
  auto grads_landed = [&e]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu) {
    return e.grad_writes == 0;
  };
  e.mu.Await(grads_landed);
  // A gradient write of this step that failed is moot: the next step
  // offloads its own gradients.
  e.grad_error = absl::OkStatus();
  StepStats skipped = e.stats;
  skipped.step = e.steps_done;
  skipped.skipped = true;
  e.ClearOffloadedGradients();
  e.ResetStats();
  return skipped;
}

absl::StatusOr<StepStats> Engine::Step(
    const std::vector<SubgroupStepInput>& inputs, const StepOptions& options) {
  Impl& e = *impl_;
  MLP_RETURN_IF_ERROR(e.ValidateStepInputs(inputs));
  MLP_RETURN_IF_ERROR(CheckGradScale(options.grad_scale));
  const int s_arrays = e.config.num_state_arrays;
  // Gradient check before anything is touched (GradScaler semantics).
  if (options.skip_if_nonfinite &&
      e.AnyGradientNonfinite(inputs, options.grad_scale)) {
    return SkipStep();
  }
  std::vector<bool> skip(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) skip[i] = inputs[i].skip;
  MLP_RETURN_IF_ERROR(BeginStep(skip));
  GradTransform transform;
  transform.grad_scale = options.grad_scale;
  for (;;) {
    auto view = Next();
    if (!view.ok()) {
      AbortStep();
      return view.status();
    }
    if (view->subgroup < 0) break;
    const int i = view->subgroup;
    if (inputs[i].skip) {  // no gradient this step: streamed, not updated
      MLP_RETURN_IF_ERROR(Done(/*updated=*/false));
      continue;
    }
    MonoTime start = MonoNow();
    OptimizerHyperparams hp = inputs[i].hp;
    hp.step = view->step + 1;
    const float* g32 = nullptr;
    if (e.eager_grads()) {
      MutexLock l(&e.mu);
      g32 = e.GradArea(e.buffer_of[i], i);
    }
    for (const Segment& seg : inputs[i].segments) {
      UpdateSpans spans;
      spans.n = seg.numel;
      spans.param = view->master + seg.offset;
      for (int k = 0; k < s_arrays && k < 3; ++k)
        spans.state[k] = view->state[k] + seg.offset;
      if (g32 != nullptr) {
        spans.grad = g32 + seg.offset;
        spans.grad_dtype = DType::kFloat32;
      } else {
        spans.grad = seg.grad;
        spans.grad_dtype = e.config.grad_dtype;
      }
      spans.param_out = seg.param_out;
      spans.param_out_dtype = options.param_out_dtype;
      auto r = ApplyOptimizer(hp, spans, transform, &e.pool);
      if (!r.ok()) {
        AbortStep();
        return Annotate(r.status(), absl::StrCat("subgroup ", i));
      }
    }
    e.stats.compute_seconds += SecondsSince(start);
    MLP_RETURN_IF_ERROR(Done());
  }
  return EndStep();
}

absl::Status Engine::ReadSubgroup(int i, float* master,
                                  const std::vector<float*>& state,
                                  int64_t* step) {
  std::vector<SubgroupState> one(1);
  one[0].subgroup = i;
  one[0].master = master;
  one[0].state = state;
  MLP_RETURN_IF_ERROR(ReadSubgroups(&one));
  if (step != nullptr) *step = one[0].step;
  return absl::OkStatus();
}

namespace {

// Copies a record's payload (master, then the state arrays, `n` floats each)
// out to `r`'s buffers (null ones skipped), or in from them (a null state
// array: zeros).
void CopyOut(const float* payload, uint64_t n, const Engine::SubgroupState& r) {
  if (r.master != nullptr) std::memcpy(r.master, payload, n * 4);
  for (size_t k = 0; k < r.state.size(); ++k) {
    if (r.state[k] != nullptr)
      std::memcpy(r.state[k], payload + (k + 1) * n, n * 4);
  }
}
void CopyIn(const Engine::SubgroupState& r, uint64_t n, float* payload) {
  std::memcpy(payload, r.master, n * 4);
  for (size_t k = 0; k < r.state.size(); ++k) {
    float* to = payload + (k + 1) * n;
    if (r.state[k] == nullptr) {
      std::memset(to, 0, n * 4);
    } else {
      std::memcpy(to, r.state[k], n * 4);
    }
  }
}

}  // namespace

absl::Status Engine::ReadSubgroups(std::vector<SubgroupState>* records) {
  Impl& e = *impl_;
  std::vector<int> which, record_of;
  MLP_RETURN_IF_ERROR(
      e.CheckStateAccess("ReadSubgroups", *records, false, &which, &record_of));
  MutexLock l(&e.mu);
  return e.VisitRecords(which,
                        [&](int i, int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu) {
                          SubgroupState& r = (*records)[record_of[i]];
                          r.step = e.sg_step[i];
                          // The buffer is this call's (claimed, or cached with
                          // no I/O in flight): the copy runs without the lock,
                          // and completions of the reads ahead keep flowing.
                          const float* payload = e.Payload(b);
                          const uint64_t n = e.numel[i];
                          e.mu.Unlock();
                          CopyOut(payload, n, r);
                          e.mu.Lock();
                          return absl::OkStatus();
                        });
}

absl::Status Engine::WriteSubgroup(int i, const float* master,
                                   const std::vector<const float*>& state,
                                   int64_t step) {
  std::vector<SubgroupState> one(1);
  one[0].subgroup = i;
  one[0].master = const_cast<float*>(master);  // read from only
  for (const float* s : state) one[0].state.push_back(const_cast<float*>(s));
  one[0].step = step;
  return WriteSubgroups(one);
}

absl::Status Engine::WriteSubgroups(const std::vector<SubgroupState>& records) {
  Impl& e = *impl_;
  std::vector<int> which, record_of;
  MLP_RETURN_IF_ERROR(
      e.CheckStateAccess("WriteSubgroups", records, true, &which, &record_of));
  MutexLock l(&e.mu);
  return e.WriteRecords(which, "writing", /*write_cached=*/false,
                        [&](int i, float* payload) {
                          CopyIn(records[record_of[i]], e.numel[i], payload);
                          return records[record_of[i]].step;
                        });
}

namespace {

absl::Status MakeDir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return ErrnoStatus(errno, "mkdir", dir);
  return absl::OkStatus();
}

absl::Status RemoveTree(const std::string& dir) {
  // Checkpoint directories are flat: files only.
  std::string cmd_dir = dir;
  DIR* d = opendir(cmd_dir.c_str());
  if (d == nullptr)
    return errno == ENOENT ? absl::OkStatus()
                           : ErrnoStatus(errno, "opendir", dir);
  std::vector<std::string> names;
  while (struct dirent* ent = readdir(d)) {
    std::string name = ent->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  for (const std::string& name : names) {
    std::string p = dir + "/" + name;
    if (unlink(p.c_str()) != 0) return ErrnoStatus(errno, "unlink", p);
  }
  if (rmdir(dir.c_str()) != 0) return ErrnoStatus(errno, "rmdir", dir);
  return absl::OkStatus();
}

bool Exists(const std::string& p) {
  struct stat st;
  return lstat(p.c_str(), &st) == 0;
}

}  // namespace

absl::Status Engine::SaveCheckpoint(const std::string& dir) {
  Impl& e = *impl_;
  if (e.in_step)
    return absl::FailedPreconditionError("SaveCheckpoint during a step");
  if (dir.empty())
    return absl::InvalidArgumentError("SaveCheckpoint: empty directory");
  // Written to a temporary sibling, then swapped in with renames: a crash at
  // any point leaves `dir` (or `dir.old`, which LoadCheckpoint also accepts)
  // holding a complete checkpoint.
  const std::string tmp = absl::StrCat(dir, ".tmp.", getpid());
  const std::string old = dir + ".old";
  MLP_RETURN_IF_ERROR(RemoveTree(tmp));
  MLP_RETURN_IF_ERROR(MakeDir(tmp));
  // A failed save leaves nothing behind (a full disk must not stay full):
  // on success `tmp` has been renamed to `dir`, and this removes nothing.
  struct RemoveOnExit {
    const std::string& path;
    ~RemoveOnExit() { RemoveTree(path).IgnoreError(); }
  } remove_tmp{tmp};
  Manifest m;
  m.run_id = e.run_id;
  m.arrays_per_param = e.arrays();
  m.subgroup_numel = e.numel;
  m.tier_of_subgroup = e.plan.tier_of_subgroup;
  {
    MutexLock l(&e.mu);
    std::vector<int> all(e.n());
    std::iota(all.begin(), all.end(), 0);
    MLP_RETURN_IF_ERROR(e.VisitRecords(
        all, [&](int i, int b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu) {
          RecordHeader h;
          h.run_id = e.run_id;
          h.subgroup = static_cast<uint32_t>(i);
          h.num_arrays = static_cast<uint32_t>(e.arrays());
          h.numel = e.numel[i];
          h.step = e.sg_step[i];
          h.payload_bytes = e.payload_bytes[i];
          h.payload_checksum = PayloadChecksum(e.Payload(b), e.payload_bytes[i],
                                               &e.pool, kStateFormatVersion);
          std::vector<char> page(kRecordHeaderBytes);
          EncodeRecordHeader(h, page.data());
          std::string path = absl::StrCat(tmp, "/sg_", i, ".ckpt");
          int fd =
              open(path.c_str(),
                   O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
          absl::Status s =
              fd < 0 ? ErrnoStatus(errno, "open", path) : absl::OkStatus();
          // Header page first, then the payload right after it.
          if (s.ok()) s = WriteFileAt(fd, page.data(), page.size(), 0, path);
          if (s.ok()) {
            s = WriteFileAt(fd, e.Payload(b), e.payload_bytes[i],
                            kRecordHeaderBytes, path);
          }
          if (s.ok() && fsync(fd) != 0) s = ErrnoStatus(errno, "fsync", path);
          if (fd >= 0) close(fd);
          return s;
        }));
  }
  MLP_RETURN_IF_ERROR(
      WriteFileAtomically(tmp + "/MANIFEST", EncodeManifest(m)));
  if (Exists(dir)) {
    MLP_RETURN_IF_ERROR(RemoveTree(old));
    if (rename(dir.c_str(), old.c_str()) != 0) {
      return ErrnoStatus(errno, "rename", absl::StrCat(dir, " to ", old));
    }
  }
  if (rename(tmp.c_str(), dir.c_str()) != 0) {
    return ErrnoStatus(errno, "rename", absl::StrCat(tmp, " to ", dir));
  }
  // Returns only once the renames, then the removal, are on disk: else a crash
  // after a successful save could bring the previous one back.
  const std::string parent = ParentDirectory(dir);
  MLP_RETURN_IF_ERROR(SyncDirectory(parent));
  MLP_RETURN_IF_ERROR(RemoveTree(old));
  return SyncDirectory(parent);
}

absl::Status Engine::Impl::OwnCheckpoint(
    const std::string& dir_in, std::vector<CheckpointRecord>* records,
    std::map<std::string, Manifest>* manifests) const {
  const std::string dir = ResolveCheckpointDir(dir_in);
  MLP_ASSIGN_OR_RETURN(Manifest m, ReadCheckpointManifest(dir));
  Manifest expected;
  expected.arrays_per_param = arrays();
  expected.subgroup_numel = numel;
  MLP_RETURN_IF_ERROR(CheckManifestMatches(expected, m, dir));
  records->resize(n());
  for (int i = 0; i < n(); ++i) (*records)[i] = {dir, i};
  manifests->emplace(dir, std::move(m));
  return absl::OkStatus();
}

absl::Status Engine::LoadCheckpoint(const std::string& dir) {
  Impl& e = *impl_;
  if (e.in_step)
    return absl::FailedPreconditionError("LoadCheckpoint during a step");
  std::vector<CheckpointRecord> records;
  std::map<std::string, Manifest> manifests;
  MLP_RETURN_IF_ERROR(e.OwnCheckpoint(dir, &records, &manifests));
  return e.LoadRecords(records, std::move(manifests));
}

absl::Status Engine::CheckCheckpoint(const std::string& dir) const {
  std::vector<CheckpointRecord> records;
  std::map<std::string, Manifest> manifests;
  MLP_RETURN_IF_ERROR(impl_->OwnCheckpoint(dir, &records, &manifests));
  return impl_->CheckRecords(records, manifests).status();
}

absl::Status Engine::LoadCheckpointRecords(
    const std::vector<CheckpointRecord>& records) {
  if (impl_->in_step)
    return absl::FailedPreconditionError("LoadCheckpoint during a step");
  return impl_->LoadRecords(records, {});
}

absl::Status Engine::CheckCheckpointRecords(
    const std::vector<CheckpointRecord>& records) const {
  std::map<std::string, Manifest> manifests;
  return impl_->CheckRecords(records, manifests).status();
}

absl::StatusOr<std::vector<std::string>> Engine::Impl::CheckRecords(
    const std::vector<CheckpointRecord>& records,
    std::map<std::string, Manifest>& manifests) const {
  const Impl& e = *this;
  if (records.size() != static_cast<size_t>(e.n())) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadCheckpointRecords: ", records.size(), " records for ",
                     e.n(), " subgroups"));
  }
  // Every source's manifest first: nothing is loaded from a checkpoint of
  // another model or optimizer.
  std::vector<std::string> dirs(records.size());
  for (int i = 0; i < e.n(); ++i) {
    dirs[i] = ResolveCheckpointDir(records[i].dir);
    auto it = manifests.find(dirs[i]);
    if (it == manifests.end()) {
      MLP_ASSIGN_OR_RETURN(Manifest m, ReadCheckpointManifest(dirs[i]));
      it = manifests.emplace(dirs[i], std::move(m)).first;
    }
    const Manifest& m = it->second;
    const int j = records[i].subgroup;
    if (m.arrays_per_param != static_cast<uint32_t>(e.arrays())) {
      return absl::FailedPreconditionError(
          absl::StrCat(dirs[i], " holds state with ", m.arrays_per_param,
                       " arrays per parameter, this optimizer needs ",
                       e.arrays(), " (another optimizer?)"));
    }
    if (j < 0 || static_cast<size_t>(j) >= m.subgroup_numel.size() ||
        m.subgroup_numel[j] != e.numel[i]) {
      return absl::FailedPreconditionError(
          absl::StrCat(dirs[i], ": has no subgroup ", j, " of ", e.numel[i],
                       " parameters (subgroup ", i, " here; another model?)"));
    }
  }
  // Then every record's file: there, whole, and its header saying what the
  // manifest does (a record missing or cut short is found before the load
  // changed anything; a payload whose checksum fails, only as it is read).
  std::vector<char> page(kRecordHeaderBytes);
  for (int i = 0; i < e.n(); ++i) {
    const int j = records[i].subgroup;
    const std::string path = absl::StrCat(dirs[i], "/sg_", j, ".ckpt");
    const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open", path);
    struct stat st;
    absl::Status s = fstat(fd, &st) == 0 ? absl::OkStatus()
                                         : ErrnoStatus(errno, "fstat", path);
    const uint64_t need = kRecordHeaderBytes + e.payload_bytes[i];
    if (s.ok() && static_cast<uint64_t>(st.st_size) < need) {
      s = absl::DataLossError(absl::StrCat(path, ": ", st.st_size,
                                           " bytes, its record needs ", need,
                                           " (cut short)"));
    }
    if (s.ok()) s = ReadFileAt(fd, page.data(), page.size(), 0, path);
    close(fd);
    MLP_RETURN_IF_ERROR(s);
    MLP_ASSIGN_OR_RETURN(RecordHeader h,
                         DecodeRecordHeader(page.data(), page.size(), path));
    MLP_RETURN_IF_ERROR(CheckCheckpointRecordHeader(
        h, j, e.numel[i], static_cast<uint32_t>(e.arrays()), path));
  }
  return dirs;
}

absl::Status Engine::Impl::LoadRecords(
    const std::vector<CheckpointRecord>& records,
    std::map<std::string, Manifest> manifests) {
  Impl& e = *this;
  MLP_ASSIGN_OR_RETURN(std::vector<std::string> dirs,
                       e.CheckRecords(records, manifests));
  // From here the state may change, even if the load fails: a commit that
  // failed before is not the state's any more (RetryCommit writes nothing).
  e.failed_commit.reset();
  MutexLock l(&e.mu);
  // The record read last goes to its tier while the next one is read from
  // the checkpoint (one write in flight).
  int writing = -1;
  auto finish_writing = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(e.mu) {
    if (writing < 0) return absl::OkStatus();
    absl::Status s = e.FinishWrite(writing);
    e.Free(writing);
    writing = -1;
    return s;
  };
  for (int i = 0; i < e.n(); ++i) {
    const int j = records[i].subgroup;
    std::string path = absl::StrCat(dirs[i], "/sg_", j, ".ckpt");
    int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      absl::Status s = ErrnoStatus(errno, "open", path);
      finish_writing().IgnoreError();
      return s;
    }
    int b = e.buffer_of[i];
    bool cached = b >= 0;
    if (cached) {
      absl::Status s = e.WaitIo(b);
      // The checkpoint's record is read into the cached one: where that
      // holds the latest version's only copy, it goes to its tier first, so
      // that a read that fails (a damaged checkpoint) loses nothing.
      if (s.ok() && !e.OnDisk(i)) {
        s = Annotate(e.WriteNow(i, b),
                     absl::StrCat("writing back subgroup ", i,
                                  " before loading its checkpoint record"));
      }
      if (!s.ok()) {
        close(fd);
        finish_writing().IgnoreError();
        return s;
      }
    } else {
      if (writing >= 0 && e.FindFreeBuffer() < 0) {
        // No second buffer: the write in flight has to land first.
        absl::Status s = finish_writing();
        if (!s.ok()) {
          close(fd);
          return s;
        }
      }
      auto claimed = e.WaitAndClaimFree(i, BufState::kInUse);
      if (!claimed.ok()) {
        close(fd);
        finish_writing().IgnoreError();
        return claimed.status();
      }
      b = *claimed;
    }
    absl::Status s =
        ReadFileAt(fd, e.buffers[b].mem.data(),
                   kRecordHeaderBytes + e.payload_bytes[i], 0, path);
    close(fd);
    RecordHeader h;
    if (s.ok()) {
      auto hs =
          DecodeRecordHeader(e.buffers[b].mem.data(), kRecordHeaderBytes, path);
      if (!hs.ok()) {
        s = hs.status();
      } else {
        h = *hs;
        s = CheckCheckpointRecordHeader(
            h, j, e.numel[i], static_cast<uint32_t>(e.arrays()), path);
        if (s.ok() && PayloadChecksum(e.Payload(b), e.payload_bytes[i], &e.pool,
                                      h.format_version) != h.payload_checksum) {
          s = absl::DataLossError(absl::StrCat(
              path, ": payload checksum mismatch (subgroup ", i, ")"));
        }
      }
    }
    if (!s.ok()) {
      if (!cached) {
        e.Free(b);
      } else {
        // The cached copy was overwritten by a partial read: its tier holds
        // the same version (written back above), read at the next use.
        e.Free(b);
        e.initialized[i] = e.current_slot[i] >= 0;
      }
      finish_writing().IgnoreError();
      return s;
    }
    e.sg_step[i] = h.step;
    e.initialized[i] = true;
    e.buffers[b].from_disk = false;
    e.SupersedeIncompleteStep(i);
    // A cached record replaced at its own step count: a commit must write
    // it (until the write, the disk holds the old version).
    if (cached) e.rewritten[i] = true;
    if (!cached) {
      // The header's checksum was just verified against this payload (in
      // its format, which the written record keeps).
      e.IssueWrite(i, b, h.payload_checksum, h.format_version);
      absl::Status previous = finish_writing();
      writing = b;
      if (!previous.ok()) {
        finish_writing().IgnoreError();
        return previous;
      }
    }
  }
  MLP_RETURN_IF_ERROR(finish_writing());
  int64_t max_step = 0;
  for (int64_t s : e.sg_step) max_step = std::max(max_step, s);
  e.steps_done = max_step;
  return absl::OkStatus();
}

}  // namespace mlp_offload
