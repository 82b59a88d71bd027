// Python bindings of the engine layer, in the submodule mlp_offload._C.engine.
//
// Thin by design: configuration crosses as plain dicts (checked key by key so
// a typo is a ConfigError naming the key), tensors as integer data pointers
// plus element counts, dtypes as names. Every blocking engine call runs with
// the GIL released; every absl::Status goes through ThrowIfError.
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "kernels/optimizer_kernels.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/threads.h"
#include "mlp_offload/engine.h"
#include "mlp_offload/planner.h"
#include "mlp_offload/state_store.h"
#include "mlp_offload/tier.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "python/bindings/registry.h"
#include "python/bindings/status.h"

namespace mlp_offload {
namespace python {
namespace {

namespace py = pybind11;

// Reads typed fields out of a dict and rejects keys nobody asked for.
class DictReader {
 public:
  DictReader(py::handle obj, std::string what) : what_(std::move(what)) {
    if (!py::isinstance<py::dict>(obj)) {
      ThrowIfError(absl::InvalidArgumentError(
          absl::StrCat(what_, ": expected a dict, got ",
                       std::string(py::str(obj.get_type().attr("__name__"))))));
    }
    dict_ = py::reinterpret_borrow<py::dict>(obj);
  }

  template <typename T>
  void Read(const char* key, T* out) {
    known_.push_back(key);
    if (!dict_.contains(key)) return;
    py::handle value = dict_[key];
    // A bool is an int to pybind11 (True: 1 thread), never a number here.
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      if (py::isinstance<py::bool_>(value)) {
        ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
            what_, ": bad value for '", key,
            "': ", std::string(py::repr(value)), " (a bool, not a number)")));
      }
    }
    try {
      *out = value.cast<T>();
    } catch (const py::cast_error&) {
      ThrowIfError(absl::InvalidArgumentError(
          absl::StrCat(what_, ": bad value for '", key,
                       "': ", std::string(py::repr(value)))));
    }
  }

  void Require(const char* key) {
    if (!dict_.contains(key)) {
      ThrowIfError(absl::InvalidArgumentError(
          absl::StrCat(what_, ": missing required key '", key, "'")));
    }
  }

  // Raises ConfigError naming the first key that no Read() asked for.
  void Finish() {
    std::set<std::string> known(known_.begin(), known_.end());
    for (auto item : dict_) {
      std::string key = py::str(item.first);
      if (known.count(key) == 0) {
        ThrowIfError(absl::InvalidArgumentError(
            absl::StrCat(what_, ": unknown key '", key,
                         "' (known: ", absl::StrJoin(known_, ", "), ")")));
      }
    }
  }

 private:
  std::string what_;
  py::dict dict_;
  std::vector<std::string> known_;
};

DType DTypeFromName(const std::string& name) {
  return ValueOrThrow(ParseDType(name));
}

TierSpec TierFromDict(py::handle obj, int index) {
  TierSpec t;
  DictReader r(obj, absl::StrCat("tier ", index));
  r.Require("path");
  r.Read("path", &t.path);
  r.Read("name", &t.name);
  r.Read("read_bytes_per_sec", &t.read_bytes_per_sec);
  r.Read("write_bytes_per_sec", &t.write_bytes_per_sec);
  r.Read("capacity_bytes", &t.capacity_bytes);
  r.Read("shared_by", &t.shared_by);
  r.Read("throttle_read_bytes_per_sec", &t.throttle_read_bytes_per_sec);
  r.Read("throttle_write_bytes_per_sec", &t.throttle_write_bytes_per_sec);
  r.Read("throttle_shared", &t.throttle_shared);
  r.Read("throttle_contention", &t.throttle_contention);
  r.Read("throttle_half_duplex", &t.throttle_half_duplex);
  r.Read("bandwidth_pool", &t.bandwidth_pool);
  r.Finish();
  return t;
}

std::vector<TierSpec> TiersFromList(const py::list& tiers) {
  std::vector<TierSpec> out;
  int i = 0;
  for (py::handle t : tiers) out.push_back(TierFromDict(t, i++));
  return out;
}

py::dict TierToDict(const TierSpec& t) {
  py::dict d;
  d["path"] = t.path;
  d["name"] = t.name;
  d["read_bytes_per_sec"] = t.read_bytes_per_sec;
  d["write_bytes_per_sec"] = t.write_bytes_per_sec;
  d["capacity_bytes"] = t.capacity_bytes;
  d["shared_by"] = t.shared_by;
  d["throttle_read_bytes_per_sec"] = t.throttle_read_bytes_per_sec;
  d["throttle_write_bytes_per_sec"] = t.throttle_write_bytes_per_sec;
  d["throttle_shared"] = t.throttle_shared;
  d["throttle_contention"] = t.throttle_contention;
  d["throttle_half_duplex"] = t.throttle_half_duplex;
  d["bandwidth_pool"] = t.bandwidth_pool;
  return d;
}

Techniques TechniquesFromDict(py::handle obj) {
  if (py::isinstance<py::str>(obj)) {
    std::string mode = obj.cast<std::string>();
    if (mode == "mlp") return Techniques::All();
    if (mode == "baseline") return Techniques::Baseline();
    ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
        "techniques: unknown mode '", mode, "' (mlp or baseline)")));
  }
  Techniques t;
  DictReader r(obj, "techniques");
  // Each switch is said: a dict that left one out would otherwise keep the
  // engine's default for it (on), an mlp run with one technique changed
  // where the caller may have meant a baseline run with one added.
  for (const char* key :
       {"multipath", "cache_reuse", "delayed_grad_conversion", "tier_lock"}) {
    r.Require(key);
  }
  r.Read("multipath", &t.multipath);
  r.Read("cache_reuse", &t.cache_reuse);
  r.Read("delayed_grad_conversion", &t.delayed_grad_conversion);
  r.Read("tier_lock", &t.tier_lock);
  r.Finish();
  return t;
}

py::dict TechniquesToDict(const Techniques& t) {
  py::dict d;
  d["multipath"] = t.multipath;
  d["cache_reuse"] = t.cache_reuse;
  d["delayed_grad_conversion"] = t.delayed_grad_conversion;
  d["tier_lock"] = t.tier_lock;
  return d;
}

IoEngineOptions IoFromDict(py::handle obj) {
  IoEngineOptions io;
  if (obj.is_none()) return io;
  DictReader r(obj, "io");
  std::string kind = "auto";
  r.Read("kind", &kind);
  r.Read("queue_depth", &io.queue_depth);
  r.Read("block_size", &io.block_size);
  r.Read("num_threads", &io.num_threads);
  r.Finish();
  if (kind == "auto") {
    io.kind = IoEngineOptions::Kind::kAuto;
  } else if (kind == "uring" || kind == "io_uring") {
    io.kind = IoEngineOptions::Kind::kUring;
  } else if (kind == "threadpool" || kind == "threads") {
    io.kind = IoEngineOptions::Kind::kThreadPool;
  } else {
    ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
        "io: unknown kind '", kind, "' (auto, uring or threadpool)")));
  }
  return io;
}

OptimizerHyperparams HyperparamsFromDict(py::handle obj) {
  OptimizerHyperparams hp;
  DictReader r(obj, "hyperparameters");
  std::string kind = OptimizerKindName(hp.kind);
  r.Require("kind");
  r.Read("kind", &kind);
  hp.kind = ValueOrThrow(ParseOptimizerKind(kind));
  r.Read("lr", &hp.lr);
  r.Read("weight_decay", &hp.weight_decay);
  r.Read("maximize", &hp.maximize);
  r.Read("beta1", &hp.beta1);
  r.Read("beta2", &hp.beta2);
  r.Read("eps", &hp.eps);
  r.Read("amsgrad", &hp.amsgrad);
  r.Read("bias_correction", &hp.bias_correction);
  r.Read("momentum", &hp.momentum);
  r.Read("dampening", &hp.dampening);
  r.Read("nesterov", &hp.nesterov);
  r.Read("lr_decay", &hp.lr_decay);
  r.Read("initial_accumulator_value", &hp.initial_accumulator_value);
  r.Read("step", &hp.step);
  r.Finish();
  return hp;
}

// (offset, numel, grad_ptr, param_out_ptr) tuples; pointers are ints, 0 = none.
std::vector<Segment> SegmentsFromList(const py::list& list) {
  std::vector<Segment> out;
  out.reserve(list.size());
  for (py::handle item : list) {
    py::tuple t;
    try {
      t = item.cast<py::tuple>();
    } catch (const py::cast_error&) {
      t = py::tuple();
    }
    if (t.size() != 4) {
      ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
          "segment: expected (offset, numel, grad_ptr, param_out_ptr), got ",
          std::string(py::repr(item)))));
    }
    Segment s;
    s.offset = t[0].cast<uint64_t>();
    s.numel = t[1].cast<uint64_t>();
    s.grad = reinterpret_cast<const void*>(t[2].cast<uintptr_t>());
    s.param_out = reinterpret_cast<void*>(t[3].cast<uintptr_t>());
    out.push_back(s);
  }
  return out;
}

// step's inputs: hyperparams is a list of dicts; inputs[i] = (index into
// hyperparams, segments[, skip]) for subgroup i.
std::vector<SubgroupStepInput> StepInputsFromLists(const py::list& hyperparams,
                                                   const py::list& inputs) {
  std::vector<OptimizerHyperparams> hps;
  for (py::handle h : hyperparams) hps.push_back(HyperparamsFromDict(h));
  std::vector<SubgroupStepInput> in;
  in.reserve(inputs.size());
  for (py::handle item : inputs) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 2 && t.size() != 3) {
      ThrowIfError(absl::InvalidArgumentError(
          "step: each input is (hyperparameter index, segments[, "
          "skip])"));
    }
    size_t h = t[0].cast<size_t>();
    if (h >= hps.size()) {
      ThrowIfError(absl::InvalidArgumentError(
          absl::StrCat("step: hyperparameter index ", h, " out of range (",
                       hps.size(), ")")));
    }
    SubgroupStepInput s;
    s.hp = hps[h];
    s.segments = SegmentsFromList(t[1].cast<py::list>());
    if (t.size() == 3) s.skip = t[2].cast<bool>();
    in.push_back(std::move(s));
  }
  return in;
}

py::dict StatsToDict(const StepStats& s) {
  py::dict d;
  d["step"] = s.step;
  d["skipped"] = s.skipped;
  d["seconds"] = s.seconds;
  d["read_wait_seconds"] = s.read_wait_seconds;
  d["compute_seconds"] = s.compute_seconds;
  d["checksum_seconds"] = s.checksum_seconds;
  d["write_wait_seconds"] = s.write_wait_seconds;
  d["grad_offload_seconds"] = s.grad_offload_seconds;
  d["grad_wait_seconds"] = s.grad_wait_seconds;
  d["cache_hits"] = s.cache_hits;
  d["subgroups_left_on_tier"] = s.subgroups_left_on_tier;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["peak_host_bytes"] = s.peak_host_bytes;
  return d;
}

// The thread on which a handle's interruptible calls run, one at a time:
// started at the first and kept (a thread per call cost about 0.25 ms, which
// a generic step pays per subgroup). A fork's child starts its own, with
// state of its own: the parent's thread is not in it, and its mutex and
// condition variable, copied mid-use, are left alone (leaked), never used.
class CallThread {
 public:
  CallThread() = default;
  CallThread(const CallThread&) = delete;
  CallThread& operator=(const CallThread&) = delete;
  ~CallThread() {
    if (thread_ == nullptr) return;
    if (owner_ != getpid()) {  // a fork's child: the parent's
      (void)thread_.release();
      (void)state_.release();
      return;
    }
    {
      MutexLock l(&state_->mu);
      state_->stop = true;
    }
    thread_->join();
  }

  // Queues `fn` (nothing else queued or running) and returns its ticket;
  // the error of a thread the system refused.
  absl::StatusOr<uint64_t> Run(std::function<void()> fn) {
    if (thread_ == nullptr || owner_ != getpid()) {
      if (thread_ != nullptr) {  // a fork's child
        (void)thread_.release();
        (void)state_.release();
      }
      auto state = std::make_unique<State>();
      State* const st = state.get();
      absl::StatusOr<std::thread> t =
          StartThread("an engine's interruptible calls", [st] { Loop(st); });
      if (!t.ok()) return t.status();
      state_ = std::move(state);
      thread_ = std::make_unique<std::thread>(*std::move(t));
      owner_ = getpid();
    }
    MutexLock l(&state_->mu);
    state_->task = std::move(fn);
    return ++state_->queued;
  }
  // Whether the call of `ticket` is over, waiting until `deadline` at most.
  bool Finished(uint64_t ticket, MonoTime deadline) {
    State* const st = state_.get();
    MutexLock l(&st->mu);
    return st->mu.AwaitWithDeadline(
        [st, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) {
          return st->finished >= ticket;
        },
        deadline);
  }

 private:
  struct State {
    Mutex mu;
    std::function<void()> task ABSL_GUARDED_BY(mu);
    uint64_t queued ABSL_GUARDED_BY(mu) = 0;
    uint64_t finished ABSL_GUARDED_BY(mu) = 0;
    bool stop ABSL_GUARDED_BY(mu) = false;
  };

  static void Loop(State* st) {
    for (;;) {
      std::function<void()> fn;
      {
        MutexLock l(&st->mu);
        st->mu.Await([st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) {
          return st->stop || st->task != nullptr;
        });
        if (st->task == nullptr) return;
        fn = std::move(st->task);
        st->task = nullptr;
      }
      fn();
      MutexLock l(&st->mu);
      ++st->finished;
    }
  }

  // Used from Python's main thread only, under the GIL.
  std::unique_ptr<State> state_;
  std::unique_ptr<std::thread> thread_;
  pid_t owner_ = 0;
};

// Closes this process's descriptors of files whose path (as /proc/self/fd
// gives it: resolved) starts with one of `prefixes`.
void CloseFilesUnder(const std::vector<std::string>& prefixes) {
  std::vector<int> fds;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (struct dirent* ent = readdir(d)) {
      int fd = -1;
      if (absl::SimpleAtoi(ent->d_name, &fd) && fd != dirfd(d)) {
        fds.push_back(fd);
      }
    }
    closedir(d);
  }
  for (int fd : fds) {
    char target[PATH_MAX];
    const std::string link = absl::StrCat("/proc/self/fd/", fd);
    const ssize_t len = readlink(link.c_str(), target, sizeof(target) - 1);
    if (len <= 0) continue;
    const absl::string_view path(target, static_cast<size_t>(len));
    for (const std::string& prefix : prefixes) {
      if (absl::StartsWith(path, prefix)) {
        close(fd);
        break;
      }
    }
  }
}

// The file prefixes (FilePrefixes) of engines being created or
// destroyed by a thread without the GIL, which a fork meanwhile must close
// too (the handle of an engine being created is not made yet, that of one
// being destroyed holds it no more), with the pid of the process doing it.
// Changed and read under the GIL.
struct Pending {
  pid_t pid;
  std::vector<std::string> prefixes;
};
std::list<Pending>& PendingFilePrefixes() {
  static auto* pending = new std::list<Pending>();
  return *pending;
}

// Lists `prefixes` among the pending while it lives (made and destroyed
// under the GIL, around a part that releases it).
class PendingFiles {
 public:
  explicit PendingFiles(std::vector<std::string> prefixes)
      : it_(PendingFilePrefixes().insert(
            PendingFilePrefixes().end(),
            Pending{getpid(), std::move(prefixes)})) {}
  ~PendingFiles() { PendingFilePrefixes().erase(it_); }
  PendingFiles(const PendingFiles&) = delete;
  PendingFiles& operator=(const PendingFiles&) = delete;

 private:
  std::list<Pending>::iterator it_;
};

// What an engine of `config` opens files under, known before it is created:
// each tier's run directory (resolved, with its trailing '/') and the prefix
// of the tier's lock and shared-throttle files (TierLockPrefix). A fork's
// child closes its copies of their descriptors.
std::vector<std::string> FilePrefixes(const EngineConfig& config) {
  std::vector<std::string> prefixes;
  for (const TierSpec& tier : config.tiers) {
    char real[PATH_MAX];
    if (realpath(tier.path.c_str(), real) == nullptr) continue;
    prefixes.push_back(absl::StrCat(real, "/", config.run_name, "/"));
    absl::StatusOr<std::string> lock =
        TierLockPrefix(config.tier_lock_dir, real);
    if (lock.ok()) prefixes.push_back(*lock);  // its locks and throttle file
  }
  return prefixes;
}

// (engine checkpoint directory, subgroup index there) pairs from Python.
std::vector<Engine::CheckpointRecord> CheckpointRecords(
    const std::vector<std::pair<std::string, int>>& records) {
  std::vector<Engine::CheckpointRecord> sources;
  sources.reserve(records.size());
  for (const auto& [dir, subgroup] : records)
    sources.push_back({dir, subgroup});
  return sources;
}

// The Python-side handle: owns the engine so that close() can destroy it
// (flushing its I/O, releasing its tiers) without waiting for the GC.
class PyEngine {
 public:
  PyEngine(std::unique_ptr<Engine> engine,
           std::vector<std::string> file_prefixes)
      : engine_(std::move(engine)),
        file_prefixes_(std::move(file_prefixes)),
        creator_(getpid()) {
    LiveEngines().insert(this);
  }
  ~PyEngine() {
    LiveEngines().erase(this);
    Close();
  }

  // Every handle alive in this process (and, in a fork's child, the
  // parent's): changed and read under the GIL.
  static std::set<PyEngine*>& LiveEngines() {
    static auto* live = new std::set<PyEngine*>();
    return *live;
  }

  // In a fork's child: closes the child's copies of the descriptors of the
  // parent's engine files (its run lock, state files, tier locks). Held
  // here, they would keep the run locked against the parent's next open
  // after the parent closed it, a lock that the parent held at its death
  // held, and removed files' space in use, for as long as the child lives.
  // Closing a copy releases nothing of the parent's. The engine is never
  // used here (get() refuses), so nothing reads these descriptors.
  void CloseInheritedFiles() {
    if (engine_ == nullptr || getpid() == creator_) return;
    CloseFilesUnder(file_prefixes_);
  }

  // The engine, for a call from Python. The Engine is used by one thread at
  // a time: while a call that released the GIL runs (a step), a call from
  // another thread raises ConcurrentUseError instead of racing it, and
  // close() too instead of destroying the engine under it.
  Engine& get() {
    if (engine_ == nullptr) {
      ThrowIfError(absl::FailedPreconditionError("the engine is closed"));
    }
    if (getpid() != creator_) ThrowInherited();
    if (busy_ > 0) {
      if (!InPollingThread()) ThrowBusy(kBusy);
      // A signal handler that Interruptible's poll runs on this thread (a
      // progress logger, a preemption handler that saves): the call being
      // polled finishes first, as when handlers ran after it. This wait
      // polls for signals too: a Ctrl-C meanwhile interrupts the call, and
      // its exception leaves the handler.
      WaitPollingSignals(*engine_, wait_polled_);
    }
    return *engine_;
  }

  void Close() {
    if (busy_ > 0 && InPollingThread()) {
      ThrowBusy(
          "close() from a signal handler while a step runs: the step would "
          "be left without its engine; close after step() returns");
    }
    if (getpid() != creator_) {
      // A fork's child: the engine's threads are not in it (destroying it
      // would wait for them for ever), and its files, locks and directories
      // are the parent's, in use there. It is left alone (leaked).
      (void)engine_.release();
      return;
    }
    if (busy_ > 0) ThrowBusy(std::string("close(): ") + kBusy);
    std::unique_ptr<Engine> engine = std::move(engine_);
    if (engine != nullptr) {
      const PendingFiles pending(file_prefixes_);
      py::gil_scoped_release release;
      engine.reset();
    }
  }
  bool closed() const { return engine_ == nullptr; }
  bool busy() const { return busy_ > 0; }

  // Returns call(engine), made without the GIL (the engine's I/O and compute
  // threads run while Python goes on): an absl::Status raises unless OK, a
  // StatusOr gives its value or raises.
  template <typename Call>
  auto WithoutGil(Call call) {
    Engine& engine = get();
    const Busy busy(this);
    auto result = [&] {
      py::gil_scoped_release release;
      return call(engine);
    }();
    return Unwrap(std::move(result));
  }

  // WithoutGil for a call that may run long (a step under a tiny bandwidth
  // cap, a slow file system), made from Python's main thread: the call runs
  // on a thread of its own while this one checks for signals every 50 ms,
  // as the interpreter does between bytecodes. When a handler raises
  // (Ctrl-C: KeyboardInterrupt), the engine is interrupted
  // (Engine::SetInterrupted: the step stops at its next subgroup, a cap's
  // held-back requests are dropped), the call is waited for, and the
  // handler's exception is raised whether the call completed or not: the
  // optimizer holds the step back as it does one that failed, and the next
  // step() finishes it. From another thread (no signals there), or where no
  // thread can be started: WithoutGil.
  template <typename Call>
  auto Interruptible(Call call) {
    if (!InMainThread()) return WithoutGil(call);
    Engine& engine = get();
    const Busy busy(this);
    using Result = decltype(call(engine));
    std::optional<Result> result;
    std::exception_ptr error;
    const absl::StatusOr<uint64_t> ticket = calls_.Run([&] {
      try {
        result.emplace(call(engine));
      } catch (...) {
        error = std::current_exception();
      }
    });
    if (!ticket.ok()) {  // no thread to spare: as WithoutGil
      py::gil_scoped_release release;
      result.emplace(call(engine));
    } else {
      std::function<bool(MonoTime)> finished =
          [this, t = *ticket](MonoTime deadline) {
            return calls_.Finished(t, deadline);
          };
      // Until the call is over, a handler run below may wait for it.
      const PollScope polling(this, finished);
      WaitPollingSignals(engine, finished);
    }
    if (error != nullptr) std::rethrow_exception(error);
    return Unwrap(std::move(*result));
  }

  // A call over `records` records: Interruptible where there are several
  // (a batch may take long), WithoutGil for one (Interruptible's hand-over
  // to its thread costs about 0.25 ms).
  template <typename Call>
  void Batch(size_t records, Call call) {
    if (records > 1) {
      Interruptible(call);
    } else {
      WithoutGil(call);
    }
  }

 private:
  // A call's result as Python sees it: a Status raises unless OK, a
  // StatusOr gives its value or raises.
  template <typename Result>
  static auto Unwrap(Result result) {
    if constexpr (std::is_same_v<Result, absl::Status>) {
      ThrowIfError(result);
    } else {
      return ValueOrThrow(std::move(result));
    }
  }

  // Waits (without the GIL) until `finished` says the call running on
  // another thread is over, checking for signals every 50 ms as the
  // interpreter would. A handler's exception (Ctrl-C: KeyboardInterrupt)
  // interrupts `engine` (Engine::SetInterrupted), waits for the call, and is
  // raised.
  static void WaitPollingSignals(
      Engine& engine, const std::function<bool(MonoTime)>& finished) {
    for (;;) {
      {
        py::gil_scoped_release release;
        if (finished(MonoAfter(absl::Milliseconds(50)))) return;
      }
      if (PyErr_CheckSignals() != 0) {
        py::error_already_set raised;  // takes the handler's exception
        {
          // Without the GIL: the interrupt hurries a cap's held-back
          // requests, whose completions may wait for the engine's lock,
          // which the step's thread may hold for a while (a long flock).
          py::gil_scoped_release release;
          engine.SetInterrupted(true);
          while (!finished(MonoAfter(absl::Seconds(1)))) {
          }
          engine.SetInterrupted(false);
        }
        throw raised;
      }
    }
  }

  // Interruptible's thread and how to wait for its call, for that call's
  // lifetime (restoring an outer one: a handler may step again).
  class PollScope {
   public:
    PollScope(PyEngine* e, std::function<bool(MonoTime)> wait)
        : e_(e),
          outer_wait_(std::move(e->wait_polled_)),
          outer_thread_(e->polling_thread_) {
      e_->wait_polled_ = std::move(wait);
      e_->polling_thread_ = PyThread_get_thread_ident();
    }
    ~PollScope() {
      e_->wait_polled_ = std::move(outer_wait_);
      e_->polling_thread_ = outer_thread_;
    }
    PollScope(const PollScope&) = delete;
    PollScope& operator=(const PollScope&) = delete;

   private:
    PyEngine* const e_;
    std::function<bool(MonoTime)> outer_wait_;
    const unsigned long outer_thread_;  // NOLINT(runtime/int): CPython's
  };

  bool InPollingThread() const {
    return wait_polled_ != nullptr &&
           PyThread_get_thread_ident() == polling_thread_;
  }

  // Marks the engine in use for its life; made and destroyed with the GIL
  // held, which guards busy_.
  class Busy {
   public:
    explicit Busy(PyEngine* e) : e_(e) { ++e_->busy_; }
    ~Busy() { --e_->busy_; }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    PyEngine* const e_;
  };

  static constexpr const char* kBusy =
      "the engine is in use by another thread's call (a step runs without "
      "the GIL): call the optimizer from one thread at a time";

  [[noreturn]] void ThrowInherited() const {
    py::object cls =
        py::module_::import("mlp_offload.errors").attr("InheritedEngineError");
    const std::string message = absl::StrCat(
        "this engine was created by process ", creator_, " and this process (",
        getpid(),
        ") is a fork of it: the engine's I/O and compute threads are not in a "
        "fork, and its tier files and locks are the parent's, in use there; "
        "create the optimizer in the process that uses it (a fork may "
        "neither step nor close the parent's)");
    PyErr_SetString(cls.ptr(), message.c_str());
    throw py::error_already_set();
  }

  [[noreturn]] static void ThrowBusy(const std::string& message) {
    py::object cls =
        py::module_::import("mlp_offload.errors").attr("ConcurrentUseError");
    PyErr_SetString(cls.ptr(), message.c_str());
    throw py::error_already_set();
  }

  // Looked up each time: a fork's child has a main thread of its own.
  static bool InMainThread() {
    return PyThread_get_thread_ident() == py::module_::import("threading")
                                              .attr("main_thread")()
                                              .attr("ident")
                                              .cast<uint64_t>();
  }

  std::unique_ptr<Engine> engine_;
  // FilePrefixes of its config: what a fork's child closes (kept here, as
  // the engine is not asked in a child, nor there any more while closing).
  const std::vector<std::string> file_prefixes_;
  CallThread calls_;     // Interruptible's
  const pid_t creator_;  // a fork's child neither uses nor destroys it
  int busy_ = 0;         // calls running without the GIL (guarded by the GIL)
  // Set by PollScope (guarded by the GIL).
  // Waits for the polled call until a deadline; whether it is over.
  std::function<bool(MonoTime)> wait_polled_;
  unsigned long polling_thread_ = 0;  // NOLINT(runtime/int): CPython's
};

// The buffers handed to initialize_subgroups, read_subgroups and
// write_subgroups are bare addresses: the caller states how many elements each
// holds, and a count that is not subgroup i's is refused before any is touched.
// (A bad index is left to the engine, which names it.)
void CheckNumel(const Engine& engine, absl::string_view call, int i,
                uint64_t numel) {
  const std::vector<uint64_t>& sizes = engine.config().subgroup_numel;
  if (i < 0 || static_cast<size_t>(i) >= sizes.size()) return;
  if (numel != sizes[i]) {
    ThrowIfError(absl::InvalidArgumentError(
        absl::StrCat(call, ": subgroup ", i, " has ", sizes[i],
                     " elements, the buffers given hold ", numel)));
  }
}

std::vector<float*> FloatPointers(const std::vector<uintptr_t>& ptrs) {
  std::vector<float*> out;
  out.reserve(ptrs.size());
  for (uintptr_t p : ptrs) out.push_back(reinterpret_cast<float*>(p));
  return out;
}

// _set_tier_free_bytes_for_testing: the size of the fake file systems.
std::atomic<uint64_t> g_fake_tier_bytes{0};

uint64_t FakeTierFreeBytes(const std::string& path) {
  const uint64_t total = g_fake_tier_bytes.load();
  const uint64_t used = internal_engine::BytesUnderForTesting(path);
  return used >= total ? 0 : total - used;
}

}  // namespace

void RegisterEngineBindings(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "engine",
      "The offload engine: planner, pipelined update phase, checkpoints.");
  m.attr("MAX_COMPUTE_THREADS") = kMaxComputeThreads;
  m.attr("MAX_IO_QUEUE_DEPTH") = kMaxQueueDepth;
  m.attr("MAX_IO_THREADS") = kMaxIoThreads;

  py::class_<Plan>(m, "Plan",
                   "Placement, caching and predicted cost of one step.")
      .def_readonly("tier_of_subgroup", &Plan::tier_of_subgroup)
      .def_readonly("record_bytes", &Plan::record_bytes)
      .def_readonly("num_cached", &Plan::num_cached)
      .def_readonly("num_buffers", &Plan::num_buffers)
      .def_readonly("prefetch_depth", &Plan::prefetch_depth)
      .def_readonly("buffer_bytes", &Plan::buffer_bytes)
      .def_readonly("host_bytes_used", &Plan::host_bytes_used)
      .def_readonly("predicted_io_seconds", &Plan::predicted_io_seconds)
      .def_readonly("predicted_compute_seconds",
                    &Plan::predicted_compute_seconds)
      .def_readonly("predicted_seconds", &Plan::predicted_seconds)
      .def_readonly("placement_kept", &Plan::placement_kept)
      .def_property_readonly(
          "traffic",
          [](const Plan& p) {
            py::list out;
            for (const TierTraffic& t : p.traffic) {
              py::dict d;
              d["bytes_read"] = t.bytes_read;
              d["bytes_written"] = t.bytes_written;
              d["seconds"] = t.seconds;
              out.append(d);
            }
            return out;
          },
          "Per tier: bytes read and written in a steady-state step, busy "
          "seconds.")
      .def_property_readonly(
          "techniques",
          [](const Plan& p) { return TechniquesToDict(p.techniques); })
      .def_property_readonly(
          "techniques_name",
          [](const Plan& p) { return p.techniques.ToString(); })
      .def("order", &Plan::Order, py::arg("step"),
           "Subgroup ids in the order step `step` (0-based) updates them.")
      .def("kept_after_update", &Plan::KeptAfterUpdate, py::arg("step"),
           py::arg("position"),
           "Whether the subgroup at `position` of the step's order stays in "
           "memory.")
      .def(
          "to_string",
          [](const Plan& p, const py::list& tiers) {
            return p.ToString(TiersFromList(tiers));
          },
          py::arg("tiers"),
          "Human-readable summary of the plan for these tiers.");

  m.def(
      "make_plan",
      [](const std::vector<uint64_t>& subgroup_numel, int arrays_per_param,
         int grad_bytes, const py::list& tiers, uint64_t host_budget_bytes,
         py::object techniques, double compute_params_per_sec, int ranks) {
        PlannerInput in;
        in.subgroup_numel = subgroup_numel;
        in.arrays_per_param = arrays_per_param;
        in.grad_bytes = grad_bytes;
        in.tiers = TiersFromList(tiers);
        in.host_budget_bytes = host_budget_bytes;
        in.techniques = TechniquesFromDict(techniques);
        in.compute_params_per_sec = compute_params_per_sec;
        in.ranks = ranks;
        return ValueOrThrow(MakePlan(in));
      },
      py::arg("subgroup_numel"), py::arg("arrays_per_param"),
      py::arg("grad_bytes"), py::arg("tiers"), py::arg("host_budget_bytes"),
      py::arg("techniques") = "mlp", py::arg("compute_params_per_sec") = 0.0,
      py::arg("ranks") = 1,
      "Plans placement, caching and order (no I/O). Tiers are dicts with the "
      "TierSpec fields; techniques is 'mlp', 'baseline' or a dict of "
      "switches.");

  m.def(
      "checkpoint_manifest",
      [](const std::string& dir) {
        Manifest manifest = ValueOrThrow(ReadCheckpointManifest(dir));
        py::dict out;
        out["arrays_per_param"] = manifest.arrays_per_param;
        out["subgroup_numel"] = manifest.subgroup_numel;
        return out;
      },
      py::arg("dir"),
      "The MANIFEST of an engine checkpoint directory: arrays_per_param "
      "(master + state) and subgroup_numel.");
  m.def(
      "read_checkpoint_record",
      [](const std::string& dir, int subgroup, uint64_t numel, uintptr_t master,
         const std::vector<uintptr_t>& state, bool verify) {
        std::vector<float*> arrays;
        arrays.reserve(state.size());
        for (uintptr_t a : state) arrays.push_back(reinterpret_cast<float*>(a));
        int64_t step = 0;
        absl::Status status;
        {
          py::gil_scoped_release release;
          status = ReadCheckpointRecord(dir, subgroup, numel,
                                        reinterpret_cast<float*>(master),
                                        arrays, verify, &step);
        }
        ThrowIfError(status);
        return step;
      },
      py::arg("dir"), py::arg("subgroup"), py::arg("numel"), py::arg("master"),
      py::arg("state"), py::arg("verify") = true,
      "Reads one subgroup's record of an engine checkpoint without an "
      "engine: the master into `master` and state array k into state[k] "
      "(fp32 addresses of `numel` floats each, 0 skips; StateMismatchError "
      "when the record holds another number); checked against the manifest, "
      "header and "
      "(with `verify`, which reads the whole payload) the payload checksum. "
      "Returns the record's step.");

  m.def(
      "read_kept_commits",
      [](const std::vector<std::string>& tier_dirs) {
        std::vector<CommitId> kept = ValueOrThrow(ReadKeptCommits(tier_dirs));
        std::vector<std::pair<int64_t, int64_t>> out;
        for (const CommitId& id : kept) out.emplace_back(id.epoch, id.step);
        return out;
      },
      py::arg("tier_dirs"),
      "The commits every tier of a run holds, newest first, as (epoch, "
      "step), read from the run's directories (in tier order) without "
      "opening it: the commits a resume of it can ask for.");

  m.def(
      "check_run_layout",
      [](const std::vector<std::string>& tier_dirs, int arrays_per_param,
         const std::vector<uint64_t>& subgroup_numel) {
        ThrowIfError(
            CheckRunLayout(tier_dirs, arrays_per_param, subgroup_numel));
      },
      py::arg("tier_dirs"), py::arg("arrays_per_param"),
      py::arg("subgroup_numel"),
      "Raises StateMismatchError (naming the file and the difference) "
      "unless the run in tier_dirs holds state of this layout (arrays per "
      "parameter, master included, and subgroup sizes), one run on every "
      "tier: a resume's manifest checks, without opening the run.");

  m.def(
      "_set_tier_free_bytes_for_testing",
      [](std::optional<uint64_t> total) {
        g_fake_tier_bytes.store(total.value_or(0));
        internal_engine::SetTierFreeBytesForTesting(
            total.has_value() ? &FakeTierFreeBytes : nullptr);
      },
      py::arg("total"),
      "Tests: every tier whose capacity comes from its free space is a file "
      "system of `total` bytes that holds only what is under the tier's "
      "path (None: statvfs again).");

  m.def(
      "_close_inherited_files",
      [] {
        for (PyEngine* engine : PyEngine::LiveEngines()) {
          engine->CloseInheritedFiles();
        }
        // Engines that a thread of the parent was creating or destroying
        // at the fork (that thread is not here).
        for (const Pending& pending : PendingFilePrefixes()) {
          if (pending.pid != getpid()) CloseFilesUnder(pending.prefixes);
        }
      },
      "In a fork's child (os.register_at_fork, mlp_offload/__init__.py): "
      "closes the child's copies of the descriptors of every engine's "
      "files; a no-op in the process that created them.");

  m.def("aligned_record_bytes", &AlignedRecordBytes, py::arg("numel"),
        py::arg("arrays_per_param"),
        "Bytes of a record of `numel` params with that many fp32 arrays, "
        "aligned.");

  py::class_<SubgroupView>(
      m, "SubgroupView",
      "A resident record (valid until Done); pointers are ints.")
      .def_readonly("subgroup", &SubgroupView::subgroup)
      .def_readonly("numel", &SubgroupView::numel)
      .def_readonly("step", &SubgroupView::step)
      .def_property_readonly("master",
                             [](const SubgroupView& v) {
                               return reinterpret_cast<uintptr_t>(v.master);
                             })
      .def_property_readonly(
          "grad32",
          [](const SubgroupView& v) {
            return reinterpret_cast<uintptr_t>(v.grad32);
          },
          "Baseline: the fp32 gradient read back from the tier (0 otherwise).")
      .def_property_readonly("state", [](const SubgroupView& v) {
        std::vector<uintptr_t> out;
        for (float* p : v.state) out.push_back(reinterpret_cast<uintptr_t>(p));
        return out;
      });

  py::class_<PyEngine>(m, "Engine",
                       "One offload engine (see mlp_offload/engine.h).")
      .def_static(
          "create",
          [](const py::list& tiers, uint64_t host_budget_bytes,
             const std::vector<uint64_t>& subgroup_numel, int num_state_arrays,
             const std::string& grad_dtype, py::object techniques,
             int compute_threads, py::object io, const std::string& run_name,
             int tier_lock_slots, const std::string& tier_lock_mode,
             const std::string& tier_lock_dir, double tier_lock_timeout_s,
             bool verify_checksums, bool fault_injection, bool resume,
             int commit_every, int64_t resume_epoch, int64_t resume_step) {
            EngineConfig config;
            config.tiers = TiersFromList(tiers);
            config.host_budget_bytes = host_budget_bytes;
            config.subgroup_numel = subgroup_numel;
            config.num_state_arrays = num_state_arrays;
            config.grad_dtype = DTypeFromName(grad_dtype);
            config.techniques = TechniquesFromDict(techniques);
            config.compute_threads = compute_threads;
            config.io = IoFromDict(io);
            config.run_name = run_name;
            config.tier_lock_slots = tier_lock_slots;
            config.tier_lock_dir = tier_lock_dir;
            // The engine refuses one <= 0; NaN has no Duration.
            if (std::isnan(tier_lock_timeout_s)) {
              throw py::value_error("tier_lock_timeout_s is NaN");
            }
            config.tier_lock_timeout = std::isinf(tier_lock_timeout_s)
                                           ? absl::InfiniteDuration()
                                           : absl::Seconds(tier_lock_timeout_s);
            if (tier_lock_mode == "exclusive") {
              config.tier_lock_mode = TierLockMode::kExclusive;
            } else if (tier_lock_mode == "per_direction") {
              config.tier_lock_mode = TierLockMode::kPerDirection;
            } else {
              throw py::value_error(
                  "tier_lock_mode must be 'exclusive' or 'per_direction', got "
                  "'" +
                  tier_lock_mode + "'");
            }
            config.verify_checksums = verify_checksums;
            config.fault_injection = fault_injection;
            config.resume = resume;
            config.commit_every = commit_every;
            config.resume_epoch = resume_epoch;
            config.resume_step = resume_step;
            std::vector<std::string> prefixes = FilePrefixes(config);
            absl::StatusOr<std::unique_ptr<Engine>> engine;
            {
              const PendingFiles pending(prefixes);
              py::gil_scoped_release release;
              engine = Engine::Create(config);
            }
            return std::make_unique<PyEngine>(ValueOrThrow(std::move(engine)),
                                              std::move(prefixes));
          },
          py::arg("tiers"), py::arg("host_budget_bytes"),
          py::arg("subgroup_numel"), py::arg("num_state_arrays"),
          py::arg("grad_dtype"), py::arg("techniques") = "mlp",
          py::arg("compute_threads") = 2, py::arg("io") = py::none(),
          py::arg("run_name") = "mlp_offload_run",
          py::arg("tier_lock_slots") = 1,
          py::arg("tier_lock_mode") = "exclusive",
          py::arg("tier_lock_dir") = "",
          py::arg("tier_lock_timeout_s") =
              std::numeric_limits<double>::infinity(),
          py::arg("verify_checksums") = true,
          py::arg("fault_injection") = false, py::arg("resume") = false,
          py::arg("commit_every") = 0, py::arg("resume_epoch") = 0,
          py::arg("resume_step") = -1,
          "Validates the config, plans, opens the tiers, creates the run "
          "directories.")
      .def("close", &PyEngine::Close,
           "Flushes and destroys the engine (releases its tiers). Idempotent.")
      .def_property_readonly("closed", &PyEngine::closed)
      .def_property_readonly(
          "busy", &PyEngine::busy,
          "Whether a call runs without the GIL: another thread's, or the "
          "step whose wait for signals ran the handler asking.")
      .def_property_readonly("plan", [](PyEngine& e) { return e.get().plan(); })
      .def_property_readonly(
          "num_subgroups", [](PyEngine& e) { return e.get().num_subgroups(); })
      .def(
          "set_step",
          [](PyEngine& e, int64_t step) {
            ThrowIfError(e.get().SetStep(step));
          },
          py::arg("step"),
          "Sets the count of completed steps after a load (the ranks of a "
          "group count alike).")
      .def_property_readonly(
          "steps", [](PyEngine& e) { return e.get().step(); },
          "Steps completed (the next step is steps + 1).")
      .def_property_readonly("resumed",
                             [](PyEngine& e) { return e.get().resumed(); })
      .def_property_readonly(
          "committed_step",
          [](PyEngine& e) { return e.get().committed_step(); },
          "The step the state on the tiers resumes from (-1: none).")
      .def_property_readonly(
          "commit_mark_error",
          [](PyEngine& e) {
            return std::string(e.get().commit_mark_error().message());
          },
          "Why the COMMITTED marks could not all be written after the last "
          "commit that tried (empty: they were, or none tried yet); each "
          "later commit tries again.")
      .def_property_readonly(
          "committed_epoch",
          [](PyEngine& e) { return e.get().committed_epoch(); },
          "The epoch of that commit: commits are (epoch, step), ordered and "
          "matched by both (a step count repeats after a load of an older "
          "step).")
      .def_property_readonly(
          "kept_commits",
          [](PyEngine& e) {
            std::vector<std::pair<int64_t, int64_t>> out;
            for (const CommitId& id : e.get().kept_commits()) {
              out.emplace_back(id.epoch, id.step);
            }
            return out;
          },
          "The commits every tier holds, newest first, as (epoch, step): "
          "the last and, where every tier kept it, the one before.")
      .def_property_readonly(
          "epoch", [](PyEngine& e) { return e.get().epoch(); },
          "The epoch of the commits made from now.")
      .def(
          "set_epoch",
          [](PyEngine& e, int64_t epoch) {
            ThrowIfError(e.get().SetEpoch(epoch));
          },
          py::arg("epoch"),
          "Starts a later epoch (after a load or a re-packing; the same on "
          "every rank).")
      .def(
          "retry_commit",
          [](PyEngine& e) {
            e.WithoutGil([&](Engine& engine) { return engine.RetryCommit(); });
          },
          "Writes the commit whose last attempt failed if the state is still "
          "that commit's (same epoch and step count); nothing otherwise.")
      .def(
          "commit",
          [](PyEngine& e) {
            e.WithoutGil([&](Engine& engine) { return engine.Commit(); });
          },
          "Commits the state as it is now as (epoch, steps) (records held in "
          "memory are written first); nothing if that is the last commit and "
          "nothing changed since.")
      .def_property_readonly(
          "step_incomplete",
          [](PyEngine& e) { return e.get().step_incomplete(); },
          "Whether an attempt of the current step failed part-way (the next "
          "step "
          "call resumes it).")
      .def(
          "add_fault",
          [](PyEngine& e, int tier, const std::string& kind,
             const std::string& op, int nth, int error,
             const std::string& path_substring) {
            FaultInjectingEngine* fi = e.get().fault_injector(tier);
            if (fi == nullptr) {
              ThrowIfError(absl::FailedPreconditionError(absl::StrCat(
                  "add_fault: no fault injector on tier ", tier,
                  " (create the engine with fault_injection=True)")));
            }
            FaultSpec f;
            if (kind == "error") {
              f.kind = FaultSpec::Kind::kError;
            } else if (kind == "short") {
              f.kind = FaultSpec::Kind::kShortTransfer;
            } else {
              ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                  "add_fault: unknown kind '", kind, "' (error or short)")));
            }
            if (op == "read") {
              f.op = IoOp::kRead;
            } else if (op == "write") {
              f.op = IoOp::kWrite;
            } else {
              ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                  "add_fault: unknown op '", op, "' (read or write)")));
            }
            f.nth = nth;
            f.error = error;
            f.path_substring = path_substring;
            fi->AddFault(f);
          },
          py::arg("tier"), py::arg("kind") = "error", py::arg("op") = "read",
          py::arg("nth") = 0, py::arg("error") = 5,
          py::arg("path_substring") = "",
          "Tests: makes the nth matching request (-1: every one) on `tier` "
          "fail "
          "('error': with errno `error`; 'short': half transferred).")
      .def(
          "clear_faults",
          [](PyEngine& e, int tier) {
            FaultInjectingEngine* fi = e.get().fault_injector(tier);
            if (fi != nullptr) fi->ClearFaults();
          },
          py::arg("tier"), "Tests: removes the faults of `tier`.")
      .def(
          "faults_fired",
          [](PyEngine& e, int tier) {
            FaultInjectingEngine* fi = e.get().fault_injector(tier);
            return fi == nullptr ? 0 : fi->fired();
          },
          py::arg("tier"), "Tests: how many injected faults of `tier` fired.")
      .def_property_readonly("tiers",
                             [](PyEngine& e) {
                               py::list out;
                               for (const TierSpec& t : e.get().config().tiers)
                                 out.append(TierToDict(t));
                               return out;
                             })
      .def(
          "initialize_subgroups",
          [](PyEngine& e,
             const std::vector<
                 std::tuple<int, uintptr_t, uint64_t, py::object>>& records,
             const std::string& dtype, bool commit_initial) {
            const DType dt = DTypeFromName(dtype);
            // The dicts are read here, with the GIL; the engine points at
            // these.
            std::vector<OptimizerHyperparams> hps(records.size());
            std::vector<Engine::SubgroupInit> inits;
            inits.reserve(records.size());
            for (size_t k = 0; k < records.size(); ++k) {
              const auto& [i, params, numel, state_init] = records[k];
              CheckNumel(e.get(), "initialize_subgroups", i, numel);
              Engine::SubgroupInit in;
              in.subgroup = i;
              in.params = reinterpret_cast<const void*>(params);
              if (!state_init.is_none()) {
                hps[k] = HyperparamsFromDict(state_init);
                in.state_init = &hps[k];
              }
              inits.push_back(in);
            }
            e.Batch(inits.size(), [&](Engine& engine) {
              return engine.InitializeSubgroups(inits, dt, commit_initial);
            });
          },
          py::arg("records"), py::arg("dtype"),
          py::arg("commit_initial") = true,
          "records = [(i, params, numel, state_init or None)], each subgroup "
          "at most once: sets subgroup i's master from `params` (a data "
          "pointer of `numel` elements of `dtype`, which must be the "
          "subgroup's), its state to the optimizer's initial values "
          "(hyperparameter dict) or zeros, step 0; written to every tier at "
          "once. With commit_initial, the call that initialises the last "
          "subgroup of a run with no commit yet commits that initial state.")
      .def(
          "offload_gradients",
          [](PyEngine& e, int i, const py::list& segments,
             bool fingerprint) -> py::object {
            std::vector<Segment> segs = SegmentsFromList(segments);
            uint64_t value = 0;
            e.WithoutGil([&](Engine& engine) {
              return engine.OffloadGradients(i, segs,
                                             fingerprint ? &value : nullptr);
            });
            if (!fingerprint) return py::none();
            return py::int_(value);
          },
          py::arg("i"), py::arg("segments"), py::arg("fingerprint") = false,
          "Baseline: converts subgroup i's gradients to fp32 and writes them "
          "out now. With fingerprint, returns their gradient_fingerprint, "
          "taken in the same pass (else None).")
      .def(
          "gradient_fingerprint",
          [](PyEngine& e, int i, const py::list& segments) {
            std::vector<Segment> segs = SegmentsFromList(segments);
            return e.WithoutGil([&](Engine& engine) {
              return engine.GradientFingerprint(i, segs);
            });
          },
          py::arg("i"), py::arg("segments"),
          "A 64-bit hash of subgroup i's gradients (training dtype): the "
          "baseline offloads them again at step time if it changed since "
          "offload_gradients.")
      .def(
          "step",
          [](PyEngine& e, const py::list& hyperparams, const py::list& inputs,
             const std::string& param_out_dtype, float grad_scale,
             bool skip_if_nonfinite) {
            std::vector<SubgroupStepInput> in =
                StepInputsFromLists(hyperparams, inputs);
            StepOptions options;
            options.param_out_dtype = DTypeFromName(param_out_dtype);
            options.grad_scale = grad_scale;
            options.skip_if_nonfinite = skip_if_nonfinite;
            return StatsToDict(e.Interruptible(
                [&](Engine& engine) { return engine.Step(in, options); }));
          },
          py::arg("hyperparams"), py::arg("inputs"), py::arg("param_out_dtype"),
          py::arg("grad_scale") = 1.0f, py::arg("skip_if_nonfinite") = false,
          "Native step. hyperparams: list of dicts; inputs[i] = (index into "
          "hyperparams, segments[, skip]) for subgroup i (skip: no gradient "
          "this "
          "step, the record is left as it is). Returns the step's stats dict.")
      .def(
          "gradients_nonfinite",
          [](PyEngine& e, const py::list& hyperparams, const py::list& inputs,
             float grad_scale) {
            std::vector<SubgroupStepInput> in =
                StepInputsFromLists(hyperparams, inputs);
            return e.WithoutGil([&](Engine& engine) {
              return engine.GradientsNonfinite(in, grad_scale);
            });
          },
          py::arg("hyperparams"), py::arg("inputs"),
          py::arg("grad_scale") = 1.0f,
          "step's gradient check alone (same arguments): whether a gradient "
          "is NaN/Inf. Touches no state.")
      .def(
          "skip_step",
          [](PyEngine& e) {
            // It waits for the baseline's gradient writes: without the GIL.
            return StatsToDict(e.WithoutGil([](Engine& engine) {
              return absl::StatusOr<StepStats>(engine.SkipStep());
            }));
          },
          "Skips the step as step() does on a non-finite gradient (another "
          "rank's); returns its stats dict.")
      .def(
          "begin_step",
          [](PyEngine& e, const std::vector<bool>& skip) {
            e.WithoutGil(
                [&](Engine& engine) { return engine.BeginStep(skip); });
          },
          py::arg("skip") = std::vector<bool>(),
          "Starts a generic step. skip (empty, or a flag per subgroup): "
          "subgroups with no gradient this step; unless resident they stay on "
          "their tier and next() does not return them.")
      .def(
          "next",
          [](PyEngine& e) {
            // Interruptible costs a hand-over to its thread (about 0.25 ms):
            // only for a record still on its way.
            if (e.get().NextIsReady()) {
              return e.WithoutGil(
                  [&](Engine& engine) { return engine.Next(); });
            }
            return e.Interruptible(
                [&](Engine& engine) { return engine.Next(); });
          },
          "The next resident record of a generic step (subgroup -1 after the "
          "last).")
      .def(
          "done",
          [](PyEngine& e, bool updated) {
            e.WithoutGil([&](Engine& engine) { return engine.Done(updated); });
          },
          py::arg("updated") = true,
          "The record returned by next() is finished (updated=False: left as "
          "it "
          "was, step count unchanged); the engine may write it back.")
      .def(
          "end_step",
          [](PyEngine& e) {
            return StatsToDict(e.Interruptible(
                [&](Engine& engine) { return engine.EndStep(); }));
          },
          "Finishes a generic step; returns its stats dict.")
      .def(
          "abort_step",
          [](PyEngine& e) {
            e.WithoutGil([](Engine& engine) {
              engine.AbortStep();
              return absl::OkStatus();
            });
          },
          "Aborts a generic step: nothing of it is committed.")
      .def(
          "read_subgroups",
          [](PyEngine& e,
             const std::vector<std::tuple<
                 int, uintptr_t, std::vector<uintptr_t>, uint64_t>>& records) {
            std::vector<Engine::SubgroupState> in;
            in.reserve(records.size());
            for (const auto& [i, master, state, numel] : records) {
              CheckNumel(e.get(), "read_subgroups", i, numel);
              Engine::SubgroupState r;
              r.subgroup = i;
              r.master = reinterpret_cast<float*>(master);
              r.state = FloatPointers(state);
              in.push_back(std::move(r));
            }
            e.Batch(in.size(),
                    [&](Engine& engine) { return engine.ReadSubgroups(&in); });
            std::vector<int64_t> steps;
            steps.reserve(in.size());
            for (const Engine::SubgroupState& r : in) steps.push_back(r.step);
            return steps;
          },
          py::arg("records"),
          "Copies the master and state arrays of each subgroup i of records = "
          "[(i, master, state, numel)] (each at most once) into the given fp32 "
          "buffers (data pointers, 0 skips one, of `numel` floats each, which "
          "must be the subgroup's), reading from every tier at once; returns "
          "their step counts in the order given.")
      .def(
          "write_subgroups",
          [](PyEngine& e, const std::vector<
                              std::tuple<int, uintptr_t, std::vector<uintptr_t>,
                                         int64_t, uint64_t>>& records) {
            std::vector<Engine::SubgroupState> in;
            in.reserve(records.size());
            for (const auto& [i, master, state, step, numel] : records) {
              CheckNumel(e.get(), "write_subgroups", i, numel);
              Engine::SubgroupState r;
              r.subgroup = i;
              r.master = reinterpret_cast<float*>(master);
              r.state = FloatPointers(state);
              r.step = step;
              in.push_back(std::move(r));
            }
            e.Batch(in.size(),
                    [&](Engine& engine) { return engine.WriteSubgroups(in); });
          },
          py::arg("records"),
          "Replaces the master, state arrays (0: zeros) and step count of each "
          "subgroup i of records = [(i, master, state, step, numel)] (each at "
          "most once) from fp32 buffers of `numel` floats each, which must be "
          "the subgroup's, writing to every tier at once. After an error no "
          "further write starts; the first "
          "error is raised, naming its subgroup (each subgroup written, or "
          "left as it was).")
      .def(
          "save_checkpoint",
          [](PyEngine& e, const std::string& dir) {
            e.WithoutGil(
                [&](Engine& engine) { return engine.SaveCheckpoint(dir); });
          },
          py::arg("dir"), "Writes the whole state to `dir` atomically.")
      .def(
          "load_checkpoint",
          [](PyEngine& e, const std::string& dir) {
            e.WithoutGil(
                [&](Engine& engine) { return engine.LoadCheckpoint(dir); });
          },
          py::arg("dir"), "Loads a checkpoint written by save_checkpoint.")
      .def(
          "load_checkpoint_records",
          [](PyEngine& e,
             const std::vector<std::pair<std::string, int>>& records) {
            const std::vector<Engine::CheckpointRecord> sources =
                CheckpointRecords(records);
            e.WithoutGil([&](Engine& engine) {
              return engine.LoadCheckpointRecords(sources);
            });
          },
          py::arg("records"),
          "Loads subgroup i from records[i] = (engine checkpoint dir, that "
          "checkpoint's subgroup index): a checkpoint saved by another rank "
          "count.")
      .def(
          "check_checkpoint",
          [](PyEngine& e, const std::string& dir) {
            e.WithoutGil(
                [&](Engine& engine) { return engine.CheckCheckpoint(dir); });
          },
          py::arg("dir"),
          "The checks load_checkpoint makes before it changes anything "
          "(manifest, every record's file and header), alone.")
      .def(
          "check_checkpoint_records",
          [](PyEngine& e,
             const std::vector<std::pair<std::string, int>>& records) {
            const std::vector<Engine::CheckpointRecord> sources =
                CheckpointRecords(records);
            e.WithoutGil([&](Engine& engine) {
              return engine.CheckCheckpointRecords(sources);
            });
          },
          py::arg("records"),
          "The checks load_checkpoint_records makes before it changes "
          "anything, alone.");
}

}  // namespace python
}  // namespace mlp_offload
