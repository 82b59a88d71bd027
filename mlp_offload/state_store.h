// The on-disk layout of the offloaded state, and its parsers.
//
// Each tier holds a run directory <tier>/<run_name>/ (mode 0700) with
//   MANIFEST        text: format version, run id, subgroups (numel, tier),
//                   arrays per parameter; refuses another model's state.
//   COMMIT          binary, replaced atomically: the last durable step and,
//                   for each subgroup on this tier, which slot holds it.
//   sg_<i>.state    two slots, each [4 KiB header | record]; a write always
//                   goes to the slot that does not hold the committed version,
//                   so a torn write never destroys the last good copy.
//   sg_<i>.grad     the baseline's fp32 gradient (eager conversion).
// One file per subgroup keeps every request a single large sequential
// transfer at an aligned offset (O_DIRECT), lets a subgroup move between
// tiers by itself, and keeps a corrupt file's damage to one subgroup.
#ifndef MLP_OFFLOAD_MLP_OFFLOAD_STATE_STORE_H_
#define MLP_OFFLOAD_MLP_OFFLOAD_STATE_STORE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mlp_offload/base/thread_pool.h"

namespace mlp_offload {

inline constexpr uint64_t kRecordHeaderBytes = 4096;
// The format written. Version 1 (read still) differs only in the payload
// checksum's chunk hash: a scalar one (about 15 GB/s a thread), where
// version 2 has StripeHash64 (kernels/checksum.h), vectorised.
inline constexpr uint32_t kStateFormatVersion = 2;
inline constexpr uint32_t kOldestStateFormatVersion = 1;

struct RecordHeader {
  uint64_t run_id = 0;
  uint32_t subgroup = 0;
  uint32_t num_arrays = 0;  // fp32 arrays: master + optimizer state
  uint64_t numel = 0;
  int64_t step = 0;  // updates applied to this record
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;
  // The format the payload checksum was computed in (PayloadChecksum's
  // format_version): a record keeps its own when a newer engine resumes it.
  uint32_t format_version = kStateFormatVersion;
};

// Writes `header` into the first kRecordHeaderBytes of `page` (zero padded),
// with a magic number, its format version and a checksum of the header. The
// format version must be one this build reads (tests write others, to see
// them refused).
void EncodeRecordHeader(const RecordHeader& header, void* page);

// Parses a header page. DataLoss naming `where` (file and slot) on a bad
// magic, version or header checksum.
absl::StatusOr<RecordHeader> DecodeRecordHeader(const void* page, size_t size,
                                                absl::string_view where);

// A fast 64-bit checksum of `n` bytes, computed over fixed chunks of this
// many bytes in parallel and combined in order (the same value for any
// thread count). `format_version` picks the chunk hash of that record format
// (kOldestStateFormatVersion..kStateFormatVersion; any other aborts): a
// stored checksum is checked in its record's format, a new one computed in
// kStateFormatVersion. No default, so that no check forgets it.
inline constexpr size_t kChecksumChunkBytes = size_t{1} << 20;
uint64_t PayloadChecksum(const void* data, size_t n, ThreadPool* pool,
                         uint32_t format_version);
// PayloadChecksum, calling visit(begin, length) on each chunk's byte range
// just before the same thread hashes it: a pass of the caller's over the
// same bytes (a conversion) reads them while they are in cache.
uint64_t PayloadChecksumVisiting(
    const void* data, size_t n, ThreadPool* pool,
    const std::function<void(size_t begin, size_t length)>& visit,
    uint32_t format_version);

struct Manifest {
  uint32_t format_version = kStateFormatVersion;
  uint64_t run_id = 0;
  uint32_t arrays_per_param = 0;
  std::vector<uint64_t> subgroup_numel;
  std::vector<int> tier_of_subgroup;
};

std::string EncodeManifest(const Manifest& manifest);
// DataLoss naming `where` for a malformed manifest.
absl::StatusOr<Manifest> ParseManifest(absl::string_view text,
                                       absl::string_view where);
// FailedPrecondition naming the first difference if `found` is not the state
// of the model described by `expected` (subgroup sizes, state layout).
absl::Status CheckManifestMatches(const Manifest& expected,
                                  const Manifest& found,
                                  absl::string_view where);

// A commit's identity: its step count and the epoch it was made in. The
// caller starts a new epoch (Engine::SetEpoch) at each load or re-packing of
// the state: a load of an older checkpoint sets the step count back, so a
// step count alone can name two commits (two branches of the run). Commits
// are ordered by (epoch, step) and tiers and ranks matched by both.
struct CommitId {
  int64_t epoch = 0;
  int64_t step = -1;
  friend bool operator==(const CommitId& a, const CommitId& b) {
    return a.epoch == b.epoch && a.step == b.step;
  }
  friend bool operator!=(const CommitId& a, const CommitId& b) {
    return !(a == b);
  }
  friend bool operator<(const CommitId& a, const CommitId& b) {
    return a.epoch != b.epoch ? a.epoch < b.epoch : a.step < b.step;
  }
};
// "step S (epoch E)", for errors.
std::string DescribeCommit(const CommitId& id);

// Which slot holds each subgroup's durable version, as of commit `id`, and
// that record's payload checksum (its header's): a slot rewritten after the
// commit at the same step count is told apart. Records of the first format
// (before epochs) read as epoch 0, checksums 0 (not known).
struct CommitRecord {
  CommitId id;
  std::vector<int64_t> subgroup_step;  // -1: not on this tier
  std::vector<uint64_t> subgroup_checksum;
  std::vector<uint8_t> subgroup_slot;
};
std::string EncodeCommitRecord(const CommitRecord& commit);
absl::StatusOr<CommitRecord> ParseCommitRecord(absl::string_view bytes,
                                               absl::string_view where);

// Writes `contents` to `path` through a temporary file, fsync and rename, then
// fsyncs the directory: readers see the old or the new file, never a mix.
// `durable` false: no fsync of either (a crash may bring the old file back,
// or leave an empty one), for a file that only adds evidence.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents,
                                 bool durable = true);
// fsyncs directory `dir`: the creation, rename or removal of an entry in it
// is durable only after this. Errors name the directory.
absl::Status SyncDirectory(const std::string& dir);
// The directory holding `path` ("." for a bare name, "/" for one at the root).
std::string ParentDirectory(std::string path);
// The run's metadata files (MANIFEST, COMMIT) are this size at most: a
// million subgroups take a few MB.
inline constexpr size_t kMaxSmallFileBytes = size_t{64} << 20;
// The whole of the regular file `path`. One larger than `max_bytes` is
// DataLoss naming it (a damaged or foreign file is not read into memory).
absl::StatusOr<std::string> ReadSmallFile(
    const std::string& path, size_t max_bytes = kMaxSmallFileBytes);
// Exactly `n` bytes at `offset` of `fd`, the file `path` (for the errors);
// a file that ends early is DataLoss naming it.
absl::Status ReadFileAt(int fd, void* data, size_t n, uint64_t offset,
                        const std::string& path);
absl::Status WriteFileAt(int fd, const void* data, size_t n, uint64_t offset,
                         const std::string& path);

// Engine checkpoints (Engine::SaveCheckpoint): a directory holding MANIFEST
// and sg_<i>.ckpt = [4 KiB header | payload] per subgroup, the payload being
// the master parameters and then each state array, numel fp32 values each.
//
// `dir`, or the `dir.old` copy a crash between SaveCheckpoint's two renames
// leaves where `dir` is missing.
std::string ResolveCheckpointDir(const std::string& dir);
// OK if the header of `path`, record `subgroup` of a checkpoint whose
// manifest says `numel` parameters and `arrays` arrays per parameter, says
// the same; else DataLoss naming the file and both sides.
absl::Status CheckCheckpointRecordHeader(const RecordHeader& header,
                                         int subgroup, uint64_t numel,
                                         uint32_t arrays,
                                         const std::string& path);
// The MANIFEST of the engine checkpoint in `dir` (resolved as above).
absl::StatusOr<Manifest> ReadCheckpointManifest(const std::string& dir);
// Reads subgroup `subgroup`'s record of the engine checkpoint in `dir`
// without an engine: the master parameters into `master` and state array k
// into state[k] (null pointers, or fewer arrays than the record has, skip
// them), streaming 1 MiB at a time, after checking it against the manifest
// and its header, and that the file holds the whole record (DataLoss "cut
// short" otherwise, also when nothing is read); with `verify`, DataLoss naming
// the file if the payload checksum does not match (the destinations then hold
// garbage). Without it only the arrays asked for are read (the checksum covers
// the whole payload): a third of the bytes for Adam's master weights alone.
// `*step`: the record's updates. `numel` is the length of each destination:
// FailedPrecondition (nothing written) when the record holds another number of
// parameters.
absl::Status ReadCheckpointRecord(const std::string& dir, int subgroup,
                                  uint64_t numel, float* master,
                                  const std::vector<float*>& state, bool verify,
                                  int64_t* step);

// Byte offset of `slot` (0 or 1) in a state file whose records are
// `record_bytes` long (aligned).
inline uint64_t SlotOffset(int slot, uint64_t aligned_record_bytes) {
  return static_cast<uint64_t>(slot) *
         (kRecordHeaderBytes + aligned_record_bytes);
}

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_MLP_OFFLOAD_STATE_STORE_H_
