// Sequential bandwidth probe of tier directories.
#include "io/bandwidth_probe.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "io/aligned_buffer.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/status_macros.h"
#include "mlp_offload/base/threads.h"

namespace mlp_offload {

absl::StatusOr<double> TimeSequentialTransfer(IoEngine& engine, File& file,
                                              IoOp op, uint64_t bytes,
                                              size_t block_size,
                                              unsigned queue_depth, bool sync) {
  if (block_size == 0 || queue_depth == 0) {
    return absl::InvalidArgumentError(
        "TimeSequentialTransfer: zero block size or queue depth");
  }
  MLP_ASSIGN_OR_RETURN(
      AlignedBuffer buffers,
      AlignedBuffer::Allocate(uint64_t{block_size} * queue_depth));
  if (op == IoOp::kWrite) {
    // Incompressible data, so a compressing or deduplicating device is not
    // flattered.
    std::mt19937_64 rng(42);
    uint64_t* words = buffers.as<uint64_t>();
    for (size_t i = 0; i < buffers.size() / sizeof(uint64_t); ++i)
      words[i] = rng();
  }
  struct Shared {
    ::mlp_offload::Mutex mu;
    std::vector<unsigned> free_slots ABSL_GUARDED_BY(mu);
    unsigned in_flight ABSL_GUARDED_BY(mu) = 0;
    absl::Status error ABSL_GUARDED_BY(mu);
  } shared;
  {
    ::mlp_offload::MutexLock lock(&shared.mu);
    for (unsigned i = 0; i < queue_depth; ++i) shared.free_slots.push_back(i);
  }
  const MonoTime start = MonoNow();
  for (uint64_t offset = 0; offset < bytes; offset += block_size) {
    unsigned slot;
    {
      ::mlp_offload::MutexLock lock(&shared.mu);
      shared.mu.Await([&shared]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared.mu) {
        return !shared.free_slots.empty() || !shared.error.ok();
      });
      if (!shared.error.ok()) break;
      slot = shared.free_slots.back();
      shared.free_slots.pop_back();
      ++shared.in_flight;
    }
    IoRequest request;
    request.op = op;
    request.file = &file;
    request.offset = offset;
    request.length =
        static_cast<size_t>(std::min<uint64_t>(block_size, bytes - offset));
    request.buffer = buffers.as<char>() + uint64_t{slot} * block_size;
    engine.Submit(request, [&shared, slot](absl::StatusOr<size_t> result) {
      ::mlp_offload::MutexLock lock(&shared.mu);
      if (!result.ok() && shared.error.ok()) shared.error = result.status();
      shared.free_slots.push_back(slot);
      --shared.in_flight;
    });
  }
  {
    ::mlp_offload::MutexLock lock(&shared.mu);
    shared.mu.Await([&shared]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared.mu) {
      return shared.in_flight == 0;
    });
    MLP_RETURN_IF_ERROR(shared.error);
  }
  if (sync && op == IoOp::kWrite) MLP_RETURN_IF_ERROR(file.Sync());
  return SecondsSince(start);
}

namespace {

struct DirProbe {
  std::string dir;
  std::string path;
  std::unique_ptr<File> file;
  std::unique_ptr<IoEngine> engine;
};

std::atomic<int> g_probe_counter{0};

// The probes of one measurement; their files are removed whatever happens.
struct Probes {
  std::vector<DirProbe> all;
  explicit Probes(size_t n) : all(n) {}
  ~Probes() {
    for (DirProbe& p : all) {
      if (p.engine) p.engine->Shutdown();
      p.file.reset();
      if (!p.path.empty()) unlink(p.path.c_str());
    }
  }
};

absl::Status CheckBytes(const char* who, const ProbeOptions& options) {
  if (options.bytes == 0 || options.bytes % kDirectIoAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": bytes (", options.bytes,
                     ") must be a positive multiple of ", kDirectIoAlignment));
  }
  // The thread-pool engine runs a thread per slot.
  if (options.queue_depth == 0 || options.queue_depth > kMaxProbeQueueDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": queue depth ", options.queue_depth,
                     " is out of range (1..", kMaxProbeQueueDepth, ")"));
  }
  return absl::OkStatus();
}

constexpr char kProbePrefix[] = ".mlp_offload_probe.";

// This host's name, as it goes into probe file names ("" if unknown). A pid
// is only meaningful on its host: on a file system that several nodes share,
// a probe judges only its own host's files.
std::string ProbeHost() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return "";
  std::string name = host;
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  return name;
}

// Removes the probe files that processes of this host no longer alive left
// in `dir` (killed mid-probe): ".mlp_offload_probe.<host>.<pid>.<n>.tmp".
// Another host's files are left alone: its pids mean nothing here.
void RemoveStaleProbeFiles(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return;  // the probe itself reports the problem
  const std::string host = ProbeHost();
  std::vector<std::string> stale;
  while (struct dirent* entry = readdir(d)) {
    absl::string_view name = entry->d_name;
    if (!absl::ConsumePrefix(&name, kProbePrefix) ||
        !absl::ConsumeSuffix(&name, ".tmp")) {
      continue;
    }
    // The host name may hold dots: the pid and counter are the last parts.
    const size_t last = name.rfind('.');
    if (last == absl::string_view::npos || last == 0) continue;
    const size_t before = name.rfind('.', last - 1);
    if (before == absl::string_view::npos || name.substr(0, before) != host) {
      continue;
    }
    int pid = 0;
    uint64_t n = 0;
    if (!absl::SimpleAtoi(name.substr(before + 1, last - before - 1), &pid) ||
        !absl::SimpleAtoi(name.substr(last + 1), &n) || pid <= 0 ||
        pid == getpid()) {
      continue;
    }
    if (kill(pid, 0) < 0 && errno == ESRCH) stale.emplace_back(entry->d_name);
  }
  const int fd = dirfd(d);
  for (const std::string& name : stale) {
    struct stat st;
    if (fstatat(fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode)) {
      (void)unlinkat(fd, name.c_str(), 0);
    }
  }
  closedir(d);
}

IoEngineOptions EngineOptions(const ProbeOptions& options) {
  IoEngineOptions engine_options;
  engine_options.kind = options.engine;
  engine_options.block_size = options.block_size;
  engine_options.queue_depth = options.queue_depth;
  engine_options.num_threads = static_cast<int>(options.queue_depth);
  return engine_options;
}

// Creates p's temporary file in `dir`, preallocated to `bytes`.
absl::Status CreateProbeFile(const std::string& dir, uint64_t bytes,
                             DirProbe& p) {
  p.dir = dir;
  RemoveStaleProbeFiles(dir);
  p.path = absl::StrCat(dir, "/", kProbePrefix, ProbeHost(), ".", getpid(), ".",
                        g_probe_counter.fetch_add(1), ".tmp");
  FileOptions file_options;
  file_options.create = true;
  file_options.truncate = true;
  file_options.preallocate_bytes = bytes;
  absl::StatusOr<std::unique_ptr<File>> file = File::Open(p.path, file_options);
  if (!file.ok()) {
    // Created before its preallocation failed (a full disk), or never: the
    // name is this process's own either way.
    (void)unlink(p.path.c_str());
    p.path.clear();
    return file.status();
  }
  p.file = std::move(*file);
  return absl::OkStatus();
}

// Bytes per second of one sequential pass over the directory's file.
absl::StatusOr<double> Measure(DirProbe& p, IoOp op,
                               const ProbeOptions& options) {
  if (op == IoOp::kRead && !p.file->direct()) {
    // Without O_DIRECT the read would come from the page cache, and
    // POSIX_FADV_DONTNEED drops only clean pages: write back the dirty ones.
    MLP_RETURN_IF_ERROR(p.file->Sync());
    (void)posix_fadvise(p.file->fd(), 0, 0, POSIX_FADV_DONTNEED);
  }
  // The fdatasync is timed with the writes: without O_DIRECT they would
  // otherwise only reach the page cache.
  MLP_ASSIGN_OR_RETURN(
      const double seconds,
      TimeSequentialTransfer(*p.engine, *p.file, op, options.bytes,
                             options.block_size, options.queue_depth,
                             /*sync=*/true));
  return static_cast<double>(options.bytes) / std::max(seconds, 1e-9);
}

}  // namespace

absl::StatusOr<std::vector<PathBandwidth>> ProbeBandwidth(
    const std::vector<std::string>& dirs, const ProbeOptions& options) {
  if (dirs.empty())
    return absl::InvalidArgumentError("ProbeBandwidth: no directories");
  MLP_RETURN_IF_ERROR(CheckBytes("ProbeBandwidth", options));
  std::vector<PathBandwidth> results(dirs.size());
  Probes cleanup(dirs.size());
  std::vector<DirProbe>& probes = cleanup.all;
  const IoEngineOptions engine_options = EngineOptions(options);
  for (size_t i = 0; i < dirs.size(); ++i) {
    DirProbe& p = probes[i];
    PathBandwidth& r = results[i];
    r.dir = dirs[i];
    struct stat st;
    if (stat(dirs[i].c_str(), &st) < 0)
      return ErrnoStatus(errno, "stat", dirs[i]);
    if (!S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ProbeBandwidth: ", dirs[i], " is not a directory"));
    }
    r.device = st.st_dev;
    absl::Status created = CreateProbeFile(dirs[i], options.bytes, p);
    if (!created.ok())
      return Annotate(created, absl::StrCat("probing ", dirs[i]));
    r.direct = p.file->direct();
    r.direct_fallback_reason = p.file->direct_fallback_reason();
    MLP_ASSIGN_OR_RETURN(p.engine, CreateIoEngine(engine_options));
  }

  // Writes before reads: a read needs the data on the device (reading
  // preallocated, never-written extents costs no I/O at all).
  for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
    for (size_t i = 0; i < dirs.size(); ++i) {
      absl::StatusOr<double> alone = Measure(probes[i], op, options);
      if (!alone.ok())
        return Annotate(alone.status(), absl::StrCat("probing ", dirs[i]));
      (op == IoOp::kWrite ? results[i].write_alone : results[i].read_alone) =
          *alone;
      (op == IoOp::kWrite ? results[i].write_together
                          : results[i].read_together) = *alone;
    }
    if (!options.together || dirs.size() < 2) continue;
    // All directories at once, started together.
    std::vector<absl::StatusOr<double>> together(dirs.size(),
                                                 absl::UnknownError("not run"));
    ::mlp_offload::Notification go;
    std::vector<std::thread> threads;
    absl::Status started;
    for (size_t i = 0; i < dirs.size() && started.ok(); ++i) {
      absl::StatusOr<std::thread> t = StartThread("a probe thread", [&, i] {
        go.WaitForNotification();
        if (started.ok()) together[i] = Measure(probes[i], op, options);
      });
      if (t.ok()) {
        threads.push_back(*std::move(t));
      } else {
        started = t.status();  // read by the threads after `go` only
      }
    }
    go.Notify();
    for (auto& t : threads) t.join();
    MLP_RETURN_IF_ERROR(started);
    for (size_t i = 0; i < dirs.size(); ++i) {
      if (!together[i].ok()) {
        return Annotate(
            together[i].status(),
            absl::StrCat("probing ", dirs[i], " together with the others"));
      }
      (op == IoOp::kWrite ? results[i].write_together
                          : results[i].read_together) = *together[i];
    }
  }

  // A drop of more than a quarter when run together is far beyond run-to-run
  // noise of a sequential transfer, and two paths that both lose it are
  // competing for one pool. Same st_dev is conclusive on its own.
  auto dropped = [](const PathBandwidth& r) {
    return r.write_together < 0.75 * r.write_alone ||
           r.read_together < 0.75 * r.read_alone;
  };
  for (size_t i = 0; i < results.size(); ++i) {
    for (size_t j = 0; j < results.size(); ++j) {
      if (i == j) continue;
      const bool same_dev = results[i].device == results[j].device;
      const bool both_dropped =
          options.together && dropped(results[i]) && dropped(results[j]);
      if (same_dev || both_dropped)
        results[i].shares_device_with.push_back(results[j].dir);
    }
  }
  return results;
}

absl::StatusOr<ConcurrencyBandwidth> ProbeConcurrency(
    const std::string& dir, int streams, const ProbeOptions& options,
    const std::function<absl::StatusOr<std::unique_ptr<IoEngine>>()>&
        make_engine) {
  if (streams < 2 || streams > kMaxProbeStreams) {
    return absl::InvalidArgumentError(
        absl::StrCat("ProbeConcurrency: streams must be in 2..",
                     kMaxProbeStreams, ", got ", streams));
  }
  MLP_RETURN_IF_ERROR(CheckBytes("ProbeConcurrency", options));
  struct stat st;
  if (stat(dir.c_str(), &st) < 0) return ErrnoStatus(errno, "stat", dir);
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ProbeConcurrency: ", dir, " is not a directory"));
  }
  // Engine e reads probes[2e] and writes probes[2e + 1].
  Probes cleanup(2 * static_cast<size_t>(streams));
  std::vector<DirProbe>& probes = cleanup.all;
  const IoEngineOptions engine_options = EngineOptions(options);
  const std::string where =
      absl::StrCat("probing ", dir, " with ", streams, " streams");
  for (size_t i = 0; i < probes.size(); ++i) {
    DirProbe& p = probes[i];
    absl::Status created = CreateProbeFile(dir, options.bytes, p);
    if (!created.ok()) return Annotate(created, where);
    if (i % 2 == 1) continue;  // the reader's engine serves both files
    absl::StatusOr<std::unique_ptr<IoEngine>> engine =
        make_engine ? make_engine() : CreateIoEngine(engine_options);
    if (!engine.ok()) return Annotate(engine.status(), where);
    p.engine = std::move(*engine);
  }
  // Every file written once, by its engine, before anything is timed.
  for (size_t i = 0; i < probes.size(); ++i) {
    absl::Status written =
        TimeSequentialTransfer(*probes[i & ~size_t{1}].engine, *probes[i].file,
                               IoOp::kWrite, options.bytes, options.block_size,
                               options.queue_depth, /*sync=*/true)
            .status();
    if (!written.ok()) return Annotate(written, where);
  }
  // `engines` engines at once, each reading its file while writing the
  // other: total bytes per second. No fdatasync in the timed part: O_DIRECT
  // writes reach the device, and an engine syncs only at its commits.
  auto run = [&](int engines) -> absl::StatusOr<double> {
    std::vector<absl::Status> status(2 * engines);
    ::mlp_offload::Notification go;
    std::vector<std::thread> threads;
    absl::Status started;
    for (int i = 0; i < 2 * engines && started.ok(); ++i) {
      absl::StatusOr<std::thread> t = StartThread("a probe thread", [&, i] {
        DirProbe& p = probes[i];
        const IoOp op = i % 2 == 0 ? IoOp::kRead : IoOp::kWrite;
        if (op == IoOp::kRead && !p.file->direct())
          (void)posix_fadvise(p.file->fd(), 0, 0, POSIX_FADV_DONTNEED);
        go.WaitForNotification();
        if (!started.ok()) return;
        status[i] = TimeSequentialTransfer(*probes[i & ~1].engine, *p.file, op,
                                           options.bytes, options.block_size,
                                           options.queue_depth,
                                           /*sync=*/false)
                        .status();
      });
      if (t.ok()) {
        threads.push_back(*std::move(t));
      } else {
        started = t.status();  // read by the threads after `go` only
      }
    }
    const MonoTime start = MonoNow();
    go.Notify();
    for (auto& t : threads) t.join();
    MLP_RETURN_IF_ERROR(started);
    const double seconds = SecondsSince(start);
    for (const absl::Status& s : status) {
      if (!s.ok()) return Annotate(s, where);
    }
    return 2.0 * engines * static_cast<double>(options.bytes) /
           std::max(seconds, 1e-9);
  };
  ConcurrencyBandwidth r;
  r.dir = dir;
  r.streams = streams;
  MLP_ASSIGN_OR_RETURN(r.one, run(1));
  MLP_ASSIGN_OR_RETURN(r.many, run(streams));
  r.contention = std::max(0.0, (r.one / r.many - 1.0) / (streams - 1));
  return r;
}

}  // namespace mlp_offload
