// Sequential read/write bandwidth of the io engines on one or more paths at
// once, to compare with fio on the same path, block size and queue depth:
//
//   bazel run -c opt //io:io_benchmark -- --paths=/nvme/x,/pfs/y --size=2G \
//       --block_size=1M --queue_depth=32 --engine=uring [--read_cap=300M]
//       [--json]
//
// Each path gets its own file (io_benchmark.<pid>.dat, removed afterwards
// unless --keep) and its own engine (one ring per path, as in the engine
// layer); all paths run at the same time. The write pass runs first so the
// read pass reads data that is really on the device.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "io/bandwidth_probe.h"
#include "io/fault_injection.h"
#include "io/file.h"
#include "io/io_engine.h"
#include "mlp_offload/base/mutex.h"

ABSL_FLAG(std::string, paths, "/tmp",
          "comma-separated directories to test at once");
ABSL_FLAG(std::string, size, "1G",
          "file size per path (K/M/G suffixes, powers of 2)");
ABSL_FLAG(std::string, block_size, "1M", "request size");
ABSL_FLAG(int, queue_depth, 32, "requests in flight per path");
ABSL_FLAG(std::string, engine, "uring", "uring | threadpool | auto");
ABSL_FLAG(int, threads, 0, "threadpool engine threads (0: queue_depth)");
ABSL_FLAG(std::string, ops, "write,read", "passes to run, in order");
ABSL_FLAG(std::string, read_cap, "",
          "per-path read cap in bytes/s (K/M/G: powers of 10), "
          "one value or one per path");
ABSL_FLAG(std::string, write_cap, "",
          "per-path write cap in bytes/s, like --read_cap");
ABSL_FLAG(bool, direct, true, "use O_DIRECT where the filesystem allows it");
ABSL_FLAG(bool, sync, false, "include an fdatasync in each write pass");
ABSL_FLAG(int, repeat, 1, "repetitions of each pass");
ABSL_FLAG(bool, prefill, false,
          "write each file once, untimed, before the timed passes, so that "
          "the first timed write overwrites written blocks (the steady state "
          "of the engine, which rewrites its state files every step) instead "
          "of converting freshly fallocated, unwritten extents");
ABSL_FLAG(bool, json, false, "one JSON object per line instead of text");
ABSL_FLAG(bool, keep, false, "keep the files");
ABSL_FLAG(bool, probe, false,
          "run ProbeBandwidth on --paths instead (alone and together)");

namespace mlp_offload {
namespace {

// "4K", "1M", "2G" (binary) or plain bytes; `decimal` for rates.
bool ParseBytes(const std::string& text, bool decimal, double* out) {
  if (text.empty()) return false;
  double mult = 1;
  std::string digits = text;
  const char suffix = static_cast<char>(toupper(text.back()));
  const double k = decimal ? 1e3 : 1024.0;
  if (suffix == 'K') mult = k;
  if (suffix == 'M') mult = k * k;
  if (suffix == 'G') mult = k * k * k;
  if (mult != 1) digits.pop_back();
  double v;
  if (!absl::SimpleAtod(digits, &v) || v < 0) return false;
  *out = v * mult;
  return true;
}

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "io_benchmark: %s\n", message.c_str());
  std::exit(1);
}

std::vector<double> Caps(const std::string& flag, size_t paths) {
  std::vector<double> caps(paths, 0);
  if (flag.empty()) return caps;
  std::vector<std::string> parts = absl::StrSplit(flag, ',');
  if (parts.size() != 1 && parts.size() != paths)
    Die("a cap list needs one value or one per path");
  for (size_t i = 0; i < paths; ++i) {
    if (!ParseBytes(parts.size() == 1 ? parts[0] : parts[i], true, &caps[i])) {
      Die("bad cap " + flag);
    }
  }
  return caps;
}

std::string JsonList(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  for (const auto& s : items) quoted.push_back(absl::StrCat("\"", s, "\""));
  return absl::StrCat("[", absl::StrJoin(quoted, ","), "]");
}

int Probe(const std::vector<std::string>& dirs, uint64_t bytes, size_t block,
          int qd) {
  ProbeOptions options;
  options.bytes = bytes;
  options.block_size = block;
  options.queue_depth = qd;
  absl::StatusOr<std::vector<PathBandwidth>> result =
      ProbeBandwidth(dirs, options);
  if (!result.ok()) Die(std::string(result.status().ToString()));
  for (const PathBandwidth& r : *result) {
    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"op\":\"probe\",\"path\":\"%s\",\"direct\":%s,\"write_alone_gb_"
          "per_s\":%.4f,"
          "\"read_alone_gb_per_s\":%.4f,\"write_together_gb_per_s\":%.4f,"
          "\"read_together_gb_per_s\":%.4f,\"shares_device_with\":%s}\n",
          r.dir.c_str(), r.direct ? "true" : "false", r.write_alone / 1e9,
          r.read_alone / 1e9, r.write_together / 1e9, r.read_together / 1e9,
          JsonList(r.shares_device_with).c_str());
    } else {
      std::printf(
          "%s: write %.3f GB/s alone, %.3f together; read %.3f alone, %.3f "
          "together;"
          " shares with [%s]%s\n",
          r.dir.c_str(), r.write_alone / 1e9, r.write_together / 1e9,
          r.read_alone / 1e9, r.read_together / 1e9,
          absl::StrJoin(r.shares_device_with, ",").c_str(),
          r.direct ? ""
                   : (" (buffered: " + r.direct_fallback_reason + ")").c_str());
    }
  }
  return 0;
}

int Main() {
  const std::vector<std::string> dirs =
      absl::StrSplit(absl::GetFlag(FLAGS_paths), ',', absl::SkipEmpty());
  if (dirs.empty()) Die("no --paths");
  double size_d, block_d;
  if (!ParseBytes(absl::GetFlag(FLAGS_size), false, &size_d)) Die("bad --size");
  if (!ParseBytes(absl::GetFlag(FLAGS_block_size), false, &block_d))
    Die("bad --block_size");
  const uint64_t size = static_cast<uint64_t>(size_d);
  const size_t block = static_cast<size_t>(block_d);
  const int qd = absl::GetFlag(FLAGS_queue_depth);
  if (qd < 1 || block == 0 || size == 0 || size % block != 0) {
    Die("need queue_depth >= 1 and a size that is a positive multiple of "
        "block_size");
  }
  if (absl::GetFlag(FLAGS_probe)) return Probe(dirs, size, block, qd);

  IoEngineOptions options;
  const std::string engine = absl::GetFlag(FLAGS_engine);
  if (engine == "uring") {
    options.kind = IoEngineOptions::Kind::kUring;
  } else if (engine == "threadpool") {
    options.kind = IoEngineOptions::Kind::kThreadPool;
  } else if (engine == "auto") {
    options.kind = IoEngineOptions::Kind::kAuto;
  } else {
    Die("bad --engine " + engine);
  }
  options.block_size = block;
  options.queue_depth = static_cast<unsigned>(qd);
  options.num_threads =
      absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : qd;
  const std::vector<double> read_caps =
      Caps(absl::GetFlag(FLAGS_read_cap), dirs.size());
  const std::vector<double> write_caps =
      Caps(absl::GetFlag(FLAGS_write_cap), dirs.size());

  std::vector<std::unique_ptr<File>> files;
  std::vector<std::unique_ptr<IoEngine>> engines;
  std::vector<std::string> paths;
  for (size_t i = 0; i < dirs.size(); ++i) {
    paths.push_back(absl::StrCat(dirs[i], "/io_benchmark.", getpid(), ".dat"));
    FileOptions file_options;
    file_options.create = true;
    file_options.try_direct = absl::GetFlag(FLAGS_direct);
    file_options.preallocate_bytes = size;
    absl::StatusOr<std::unique_ptr<File>> file =
        File::Open(paths.back(), file_options);
    if (!file.ok()) Die(std::string(file.status().ToString()));
    if (!(*file)->direct() && absl::GetFlag(FLAGS_direct) &&
        !absl::GetFlag(FLAGS_json)) {
      std::fprintf(stderr, "warning: %s is buffered: %s\n",
                   paths.back().c_str(),
                   (*file)->direct_fallback_reason().c_str());
    }
    files.push_back(std::move(*file));
    absl::StatusOr<std::unique_ptr<IoEngine>> e = CreateIoEngine(options);
    if (!e.ok()) Die(std::string(e.status().ToString()));
    std::unique_ptr<IoEngine> eng = std::move(*e);
    if (read_caps[i] > 0 || write_caps[i] > 0) {
      eng = MakeThrottledEngine(std::move(eng), read_caps[i], write_caps[i]);
    }
    engines.push_back(std::move(eng));
  }

  if (absl::GetFlag(FLAGS_prefill)) {
    for (size_t i = 0; i < dirs.size(); ++i) {
      absl::StatusOr<double> s =
          TimeSequentialTransfer(*engines[i], *files[i], IoOp::kWrite, size,
                                 block, static_cast<unsigned>(qd),
                                 /*sync=*/true);
      if (!s.ok()) Die(std::string(s.status().ToString()));
    }
  }
  // Whether the next write pass lands on written blocks.
  bool written = absl::GetFlag(FLAGS_prefill);
  const std::vector<std::string> ops =
      absl::StrSplit(absl::GetFlag(FLAGS_ops), ',', absl::SkipEmpty());
  for (int rep = 0; rep < absl::GetFlag(FLAGS_repeat); ++rep) {
    for (const std::string& op_name : ops) {
      if (op_name != "read" && op_name != "write")
        Die("bad --ops entry " + op_name);
      const IoOp op = op_name == "read" ? IoOp::kRead : IoOp::kWrite;
      std::vector<absl::StatusOr<double>> seconds(dirs.size(), 0.0);
      ::mlp_offload::Notification go;
      std::vector<std::thread> threads;
      for (size_t i = 0; i < dirs.size(); ++i) {
        threads.emplace_back([&, i] {
          go.WaitForNotification();
          seconds[i] = TimeSequentialTransfer(*engines[i], *files[i], op, size,
                                              block, static_cast<unsigned>(qd),
                                              absl::GetFlag(FLAGS_sync));
        });
      }
      go.Notify();
      for (auto& t : threads) t.join();
      double slowest = 0;
      std::vector<double> per_path;
      for (size_t i = 0; i < dirs.size(); ++i) {
        if (!seconds[i].ok()) Die(std::string(seconds[i].status().ToString()));
        slowest = std::max(slowest, *seconds[i]);
        per_path.push_back(static_cast<double>(size) / *seconds[i] / 1e9);
      }
      const uint64_t total = size * dirs.size();
      // A write into fallocated, never written extents also pays for
      // converting them to written (ext4/xfs); an overwrite does not.
      const char* file_state = written ? "written" : "fallocated";
      if (op == IoOp::kWrite) written = true;
      const double gbps = static_cast<double>(total) / slowest / 1e9;
      if (absl::GetFlag(FLAGS_json)) {
        std::printf(
            "{\"op\":\"%s\",\"engine\":\"%s\",\"paths\":%s,\"block_size\":%zu,"
            "\"queue_depth\":%d,\"bytes\":%llu,\"seconds\":%.4f,\"gb_per_s\":%."
            "4f,"
            "\"per_path_gb_per_s\":[%s],\"direct\":%s,\"read_cap\":\"%s\","
            "\"write_cap\":\"%s\",\"file_state\":\"%s\"}\n",
            op_name.c_str(), engines[0]->name().c_str(), JsonList(dirs).c_str(),
            block, qd, static_cast<unsigned long long>(total), slowest, gbps,
            absl::StrJoin(
                per_path, ",",
                [](std::string* out, double v) { absl::StrAppend(out, v); })
                .c_str(),
            files[0]->direct() ? "true" : "false",
            absl::GetFlag(FLAGS_read_cap).c_str(),
            absl::GetFlag(FLAGS_write_cap).c_str(), file_state);
      } else {
        std::printf(
            "%-5s %-22s bs=%zu qd=%d paths=%zu bytes=%llu file=%s: %.3f GB/s "
            "(per path: %s)\n",
            op_name.c_str(), engines[0]->name().c_str(), block, qd, dirs.size(),
            static_cast<unsigned long long>(total), file_state, gbps,
            absl::StrJoin(per_path, ", ").c_str());
      }
      std::fflush(stdout);
    }
  }
  for (auto& e : engines) e->Shutdown();
  files.clear();
  if (!absl::GetFlag(FLAGS_keep)) {
    for (const auto& p : paths) unlink(p.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace mlp_offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlp_offload::Main();
}
