// The offload engine: runs the update phase of a training step over
// optimizer state that lives on host memory and several storage tiers.
//
// For each subgroup, in the plan's order: make its record resident (a cache
// hit, or wait for its prefetch), run the kernel (or hand the record to the
// caller, for optimizers without a native kernel), then write it back unless
// the next step starts with it. Reads run ahead and writes behind, within the
// host budget. Every technique of the paper (arXiv 2509.02480) can be switched
// off; all off is the ZeRO-Infinity-like baseline, in the same engine.
#ifndef MLP_OFFLOAD_MLP_OFFLOAD_ENGINE_H_
#define MLP_OFFLOAD_MLP_OFFLOAD_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "io/fault_injection.h"
#include "io/io_engine.h"
#include "kernels/optimizer_kernels.h"
#include "mlp_offload/planner.h"
#include "mlp_offload/state_store.h"
#include "mlp_offload/tier.h"

namespace mlp_offload {

// How the tier lock (technique 4) covers a process's I/O on a tier.
enum class TierLockMode { kExclusive, kPerDirection };

// The path prefix of the tier lock of the directory `tier_dir` (resolved
// with realpath) in `lock_dir` ("" as in EngineConfig::tier_lock_dir): the
// same for every process of this user on this node that uses the tier. The
// lock's file is this plus ".tickets" (TierLockMode::kPerDirection:
// ".read.tickets" and ".write.tickets"). Errors name the directory at fault.
absl::StatusOr<std::string> TierLockPrefix(const std::string& lock_dir,
                                           const std::string& tier_dir);

// The state file of the shared throttle of the tier directory `tier_dir`
// (TierSpec::throttle_shared): TierLockPrefix plus ".throttle", node-local
// like the tier locks (one emulated device per node and tier; a fresh file
// resets its clocks).
absl::StatusOr<std::string> SharedThrottlePath(const std::string& lock_dir,
                                               const std::string& tier_dir);

// The commits that every tier of a run holds (as its COMMIT or a readable
// COMMIT.prev), newest first, read from the run's directories `tier_dirs`
// (in tier order) without opening the run: the commits a resume of it can
// ask for (EngineConfig::resume_epoch/resume_step), for a caller choosing
// between run directories. No manifest check (CheckRunLayout).
// FailedPrecondition if a tier has no COMMIT, DataLoss if one is damaged
// or older than a commit that the COMMITTED marks say reached every tier (a
// tier's files replaced by an older copy; a resume refuses it too); empty
// if the tiers share none.
absl::StatusOr<std::vector<CommitId>> ReadKeptCommits(
    const std::vector<std::string>& tier_dirs);
// Whether the run in `tier_dirs` holds state of this layout (state arrays
// per parameter, master included, and subgroup sizes), one run on every
// tier: the manifest checks of a resume, without opening the run.
// FailedPrecondition naming the file and the difference otherwise.
absl::Status CheckRunLayout(const std::vector<std::string>& tier_dirs,
                            int arrays_per_param,
                            const std::vector<uint64_t>& subgroup_numel);

// The most update threads an engine runs (more is a typo, not a machine).
inline constexpr int kMaxComputeThreads = 1024;

struct EngineConfig {
  // A tier's capacity_bytes of 0 (the default) is taken as its file system's
  // free space plus the space this run's state files in its directory hold
  // already (a resume, or a run that reuses the directory, rewrites them in
  // place); a capacity given is the room for all of the run's files on the
  // tier, those included.
  std::vector<TierSpec> tiers;
  uint64_t host_budget_bytes = 0;
  std::vector<uint64_t> subgroup_numel;
  // fp32 state arrays per parameter besides the master copy. For a native
  // optimizer: NumStateArrays(hp); for the generic path: whatever the wrapped
  // optimizer keeps per parameter.
  int num_state_arrays = 2;
  DType grad_dtype = DType::kBFloat16;  // the model's gradient dtype
  Techniques techniques;
  int compute_threads = 2;  // 1..kMaxComputeThreads
  IoEngineOptions io;
  // Subdirectory created under every tier path for this run's files.
  std::string run_name = "mlp_offload_run";
  int tier_lock_slots = 1;  // processes per tier at a time
  // With the tier lock: kExclusive, a process's reads and writes of a tier
  // hold one lock; kPerDirection, reads one and writes another, so one
  // process may read a tier while another writes it (the last writes of one
  // turn overlap the first reads of the next). Every process sharing a tier
  // must use the same mode (they use different lock files).
  TierLockMode tier_lock_mode = TierLockMode::kExclusive;
  // How long a tier's I/O may wait for the tier lock (a process sharing the
  // tier that holds it and is stopped or hung would otherwise hold up this
  // one for ever): past it, the requests fail with DeadlineExceeded naming
  // the lock. The same bound holds for the lock of a shared throttle's state
  // file (TierSpec::throttle_shared). InfiniteDuration: no limit.
  absl::Duration tier_lock_timeout = absl::InfiniteDuration();
  // The node-local directory of the tier locks' files ("": /dev/shm, or /tmp
  // where there is none). A tier's lock is named after its resolved path and
  // the user (TierLockPrefix), so the processes of one node that share a tier
  // take turns on it, while the other nodes that share it (a parallel file
  // system) have their own turns, as in the paper, and no lock ever depends on
  // a network file system's locking.
  std::string tier_lock_dir;
  bool verify_checksums = true;  // on every read
  // Wrap each tier's I/O engine in a FaultInjectingEngine (tests).
  bool fault_injection = false;
  // Reuse the state already on the tiers (the last committed step) instead
  // of starting fresh. See Engine::Create.
  bool resume = false;
  // With resume: the commit to resume, (resume_epoch, resume_step)
  // (resume_step -1: the newest one every tier holds). Each tier keeps its
  // last two commit records, so this may be the one before the newest as
  // long as no step ran after that commit: how the ranks of a process group
  // that crashed part-way through a commit agree on one state.
  int64_t resume_epoch = 0;
  int64_t resume_step = -1;
  // Make the live state durable every this many steps (0: never): the
  // records kept in host memory are written too, and a commit record names
  // the slot of every subgroup, so a crash resumes from that step.
  int commit_every = 0;
};

// One parameter (or a contiguous run of them) inside a subgroup: elements
// [offset, offset + numel) of the subgroup's flat record.
struct Segment {
  uint64_t offset = 0;
  uint64_t numel = 0;
  const void* grad = nullptr;  // numel elements of EngineConfig::grad_dtype
  void* param_out = nullptr;   // optional: the model's parameter to refresh
};

struct SubgroupStepInput {
  OptimizerHyperparams hp;        // hp.step is ignored: the engine counts
  std::vector<Segment> segments;  // cover the subgroup's elements once each
  // No gradient this step (frozen or unused parameters): the record is not
  // updated and its step count stays; segments may be empty.
  bool skip = false;
};

struct StepOptions {
  DType param_out_dtype = DType::kBFloat16;
  float grad_scale = 1.0f;  // 1/loss_scale (and clip coefficient)
  // Check every gradient first; if one is NaN/Inf nothing is updated.
  bool skip_if_nonfinite = false;
};

// Where the time of one step went and what crossed each tier.
struct StepStats {
  int64_t step = 0;
  bool skipped = false;  // non-finite gradients: nothing updated
  double seconds = 0;
  double read_wait_seconds = 0;  // compute thread waiting on reads
  double compute_seconds = 0;    // kernels (or the caller's generic step)
  // Hashing records on the compute thread (the compute pool's threads):
  // each read's verification (verify_checksums; not in read_wait_seconds)
  // and each write's payload checksum for its header.
  double checksum_seconds = 0;
  double write_wait_seconds = 0;  // waiting on writes at the end / for buffers
  double grad_offload_seconds = 0;  // baseline: eager grad conversion + writes
  // Baseline: of grad_offload_seconds, the wait at the step's start for the
  // gradient writes to land (the rest is OffloadGradients' own time).
  double grad_wait_seconds = 0;
  int cache_hits = 0;
  // Subgroups with no gradient this step (BeginStep's skip) that were not
  // resident: left on their tier, neither read nor written.
  int subgroups_left_on_tier = 0;
  std::vector<uint64_t> bytes_read;     // per tier
  std::vector<uint64_t> bytes_written;  // per tier
  uint64_t peak_host_bytes = 0;  // engine buffers in use, high-water mark
};

// A resident record handed to the caller (generic path, state access).
struct SubgroupView {
  int subgroup = -1;
  uint64_t numel = 0;
  float* master = nullptr;    // fp32 master parameters
  std::vector<float*> state;  // num_state_arrays arrays
  float* grad32 = nullptr;    // baseline: the fp32 gradient read back
  int64_t step = 0;           // updates applied so far
};

class Engine {
 public:
  // Validates the config (errors name the problem: a missing or unwritable
  // tier path, two tiers on one directory, a tier in use by another live run,
  // a budget too small, a subgroup of size 0), plans, opens the tiers and
  // creates the run directories. With config.resume and a matching manifest
  // on the tiers, the existing state is used; otherwise the state is
  // uninitialised until InitializeSubgroup is called for every subgroup.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const EngineConfig& config);
  ~Engine();

  const Plan& plan() const;
  const EngineConfig& config() const;
  int num_subgroups() const;
  // Steps completed (the next Step is step() + 1).
  int64_t step() const;
  // Sets that count after a load: a loaded checkpoint sets it to its
  // subgroups' largest step count, which is less than the run's step where
  // the subgroups of this engine all skipped some steps (no gradients); the
  // ranks of a group must count alike, since commits are labelled with it.
  // Not below any subgroup's count, nor within or after a failed step.
  absl::Status SetStep(int64_t step);
  // Whether an earlier attempt of the current step failed part-way (the next
  // Step resumes it, see AbortStep).
  bool step_incomplete() const;
  // Whether Create found and reused state on the tiers.
  bool resumed() const;

  // Sets subgroup `i`'s master parameters from `numel` values of `dtype` and
  // its state arrays to `state_init` (or zeros when null), step count 0, and
  // writes the record to its tier (or keeps it cached). With commit_initial
  // and config.commit_every > 0, the call that leaves every subgroup
  // initialised in a run with no commit yet commits that initial state
  // (step 0); loads pass false and commit with Commit() if they must.
  absl::Status InitializeSubgroup(
      int i, const void* params, DType dtype,
      const OptimizerHyperparams* state_init = nullptr,
      bool commit_initial = true);
  // InitializeSubgroup for several subgroups (each at most once; their
  // params all of `dtype`), with the writes in flight on every tier at once
  // (see WriteSubgroups, which it follows after an error).
  struct SubgroupInit {
    int subgroup = -1;
    const void* params = nullptr;
    const OptimizerHyperparams* state_init = nullptr;  // null: zeros
  };
  absl::Status InitializeSubgroups(const std::vector<SubgroupInit>& inits,
                                   DType dtype, bool commit_initial = true);

  // Baseline (delayed_grad_conversion off): called as gradients become final
  // during backward; converts them to fp32 and writes them to the subgroup's
  // tier, as ZeRO-Infinity does. With delayed conversion on, it only checks
  // its arguments (the gradient stays where it is until Step). With
  // `fingerprint`, it also gets GradientFingerprint(i, segments), taken in
  // the conversion's pass over the gradients (one read of them, not two).
  absl::Status OffloadGradients(int i, const std::vector<Segment>& segments,
                                uint64_t* fingerprint = nullptr);

  // A 64-bit hash of subgroup `i`'s gradients as `segments` point to them
  // (their bytes in the training dtype, in subgroup order). The baseline
  // keeps the one taken when OffloadGradients ran and compares it at step
  // time: gradients changed after that (GradScaler.unscale_, an in-place
  // change through .data, a new tensor) are offloaded again, whatever the
  // tensors' version counters say.
  absl::StatusOr<uint64_t> GradientFingerprint(
      int i, const std::vector<Segment>& segments);

  // The native path: one update of every subgroup with its kernel.
  // inputs[i] belongs to subgroup i. Like BeginStep, FailedPrecondition
  // before anything changes if the step is due a commit that would not be
  // newer than the last one (a load set the step count back: SetEpoch).
  absl::StatusOr<StepStats> Step(const std::vector<SubgroupStepInput>& inputs,
                                 const StepOptions& options);

  // Step's gradient check alone (inputs as for Step; the baseline uses the
  // flags recorded by OffloadGradients): whether a gradient is NaN/Inf.
  // Sharded runs agree on it across ranks before any of them updates, so
  // that a NaN in one rank's subgroups skips the step on every rank.
  absl::StatusOr<bool> GradientsNonfinite(
      const std::vector<SubgroupStepInput>& inputs, float grad_scale);
  // Skips this step as Step does on a non-finite gradient (nothing updated,
  // the baseline's offloaded gradients dropped); returns the stats of the
  // skipped step.
  StepStats SkipStep();

  // The generic path: the caller updates each record itself.
  //   BeginStep(); while ((v = Next()) valid) { update v; Done(); } EndStep();
  // Next returns the subgroups in the plan's order, prefetched, with
  // subgroup == -1 after the last one.
  // skip (empty, or one flag per subgroup): subgroup i has no gradient this
  // step (a frozen layer) and is not updated. Unless its record is resident
  // it stays on its tier, neither read nor written, and Next does not return
  // it; a resident one is returned as usual (to be passed on with
  // Done(false)). Step passes its inputs' skip flags.
  absl::Status BeginStep(const std::vector<bool>& skip = {});
  absl::StatusOr<SubgroupView> Next();
  // Whether Next would return without waiting for I/O (its record is
  // resident, or there is none to return): a caller may then skip what it
  // does to keep a wait interruptible.
  bool NextIsReady();
  // The record handed out by Next is finished (updated == false: left as it
  // was, step count unchanged) and goes back to its tier or the cache (not
  // written when it is not updated and its tier holds it already).
  absl::Status Done(bool updated = true);
  absl::StatusOr<StepStats> EndStep();
  // Ends a step that failed part-way (an I/O error, an exception in the
  // caller's update). Nothing is lost or rolled back: the subgroups already
  // finished keep their new versions (on disk or in memory), the others keep
  // their old ones, and the record being updated when it failed is kept as
  // it is in memory. The next Step/BeginStep resumes the same step and
  // updates only the subgroups it has not finished, so retrying with the
  // same gradients gives exactly the state of an uninterrupted step. (The
  // generic path's caller should restore a record its update left half
  // written before calling AbortStep.)
  void AbortStep();

  // For a caller that must stop a step soon (Ctrl-C), from another thread:
  // while interrupted, Next (and so Step) returns Cancelled instead of the
  // next subgroup, reads ahead are not issued, and requests a tier's
  // bandwidth cap holds back fail at once (IoEngine::SetInterrupted);
  // requests the device has are waited for. Step then ends as a failed step
  // does (AbortStep: the subgroups finished keep their update, the next step
  // resumes the rest). ReadSubgroup(s), WriteSubgroup(s),
  // InitializeSubgroup(s) and SaveCheckpoint likewise return Cancelled at
  // their next record (SaveCheckpoint leaving the previous checkpoint as it
  // was). In effect until SetInterrupted(false), which the caller must call
  // before the next call. Thread-safe.
  void SetInterrupted(bool interrupted);

  // Copies subgroup `i`'s master parameters and state arrays out (fp32) or in,
  // whichever tier (or cache) holds them. For state_dict / load_state_dict.
  absl::Status ReadSubgroup(int i, float* master,
                            const std::vector<float*>& state, int64_t* step);
  absl::Status WriteSubgroup(int i, const float* master,
                             const std::vector<const float*>& state,
                             int64_t step);
  // One subgroup's state outside the engine (fp32, the subgroup's size each),
  // for ReadSubgroups and WriteSubgroups.
  struct SubgroupState {
    int subgroup = -1;
    float* master = nullptr;
    std::vector<float*> state;  // one per state array
    int64_t step = 0;
  };
  // ReadSubgroup for several subgroups (each at most once), sooner: the
  // tiers take turns, and every tier reads ahead while a record is copied
  // out. Null pointers skip (the masters alone, say); each `step` is set.
  // The first error stops the call (the records before it were copied), as
  // does SetInterrupted (Cancelled).
  absl::Status ReadSubgroups(std::vector<SubgroupState>* records);
  // WriteSubgroup for several subgroups (each at most once; a null state
  // array writes zeros, the master is required): the tiers take turns, and
  // the writes are in flight on every tier at once, as many as the host
  // buffers allow. After an error no further write is started, the ones in
  // flight are finished, and the first error is returned naming its
  // subgroup: each subgroup written as WriteSubgroup would have written it,
  // or left as it was (or its new record kept in memory, where its write
  // went over its only copy of the latest version: see WriteSubgroup).
  // SetInterrupted stops it the same way (Cancelled). Arguments are checked
  // before anything is written.
  absl::Status WriteSubgroups(const std::vector<SubgroupState>& records);

  // Writes the whole state (every tier, every cached record) to `dir`
  // atomically: a crash mid-save leaves the previous checkpoint intact.
  absl::Status SaveCheckpoint(const std::string& dir);
  // Loads a checkpoint; FailedPrecondition naming the mismatch when it was
  // written for other subgroup sizes or state layout. A step that failed
  // part-way is abandoned: the loaded state replaces it (as do
  // InitializeSubgroup and WriteSubgroup, subgroup by subgroup).
  absl::Status LoadCheckpoint(const std::string& dir);

  // One subgroup's record in a checkpoint that another engine wrote (the
  // same model saved by another number of ranks): that engine's checkpoint
  // directory and its index of the subgroup.
  struct CheckpointRecord {
    std::string dir;
    int subgroup = 0;
  };
  // Loads subgroup i of this engine from records[i], one per subgroup: a
  // checkpoint resharded to another rank count. Every source must be a
  // complete checkpoint whose manifest and record header agree with this
  // engine's subgroup i (size, state layout) and whose payload checksum
  // matches; FailedPrecondition / DataLoss naming the file otherwise.
  absl::Status LoadCheckpointRecords(
      const std::vector<CheckpointRecord>& records);
  // The checks that LoadCheckpoint / LoadCheckpointRecords make before
  // they change anything, alone: the manifests, and every record's file
  // (there, as long as its record, with a header that agrees). A load that
  // passed them can still fail part-way (a payload whose checksum fails, an
  // I/O error), leaving the state part loaded.
  absl::Status CheckCheckpoint(const std::string& dir) const;
  absl::Status CheckCheckpointRecords(
      const std::vector<CheckpointRecord>& records) const;

  // Per-tier fault injectors (config.fault_injection), else nullptr.
  FaultInjectingEngine* fault_injector(int tier) const;
  // The step that the state on the tiers can be resumed from (-1: none).
  int64_t committed_step() const;
  // The epoch of that commit (see CommitId in state_store.h).
  int64_t committed_epoch() const;
  // Why the COMMITTED mark (the newest commit of this run that reached
  // every tier; see recovery.py) could not be written on some tier after
  // the last commit; OK if it was, or no commit was made yet. Without the
  // mark, a tier that loses the run's only commit record looks like a first
  // commit that reached some tiers only, and a tier restored from an older
  // copy like a crash between the tiers' records. Each commit writes it.
  absl::Status commit_mark_error() const;
  // The commits that every tier holds, newest first: the last one and,
  // where every tier kept it (COMMIT.prev), the one before, as of the last
  // commit or the resume. A resume may go back to either (config.
  // resume_step) as long as no step wrote since (writes go to the slots of
  // the one before; its records then fail the header check): what the
  // ranks of a group compare to find the newest commit all of them hold.
  const std::vector<CommitId>& kept_commits() const;
  // The epoch of the commits made from now (0 in a fresh run; a resumed
  // engine's is its commit's). A commit is identified by (epoch, step
  // count), and each must be newer than the last: after a load that sets
  // the step count back (or a re-packed state), the caller starts a later
  // epoch, the same on every rank of a group. InvalidArgument to go back,
  // FailedPrecondition during a step.
  int64_t epoch() const;
  absl::Status SetEpoch(int64_t epoch);
  // Commits the state as it is now, as (epoch(), step()): every record held
  // in memory is written to its tier first (the slots the last commit names
  // stay untouched until the new record lands). For state written with
  // WriteSubgroup outside a step (a re-packed or loaded state) that must
  // survive a crash. OK with nothing to write if that commit is the last
  // one and nothing changed since. FailedPrecondition during a step, with a
  // failed step pending, with commit_every 0, with a subgroup never
  // initialised, or when the commit would not be newer than the last one
  // (or is the last one and the state changed since): SetEpoch first.
  absl::Status Commit();
  // Writes the commit whose last attempt failed (after the step itself
  // completed: a full tier, say), if the state is still that commit's (same
  // epoch and step count, and no load, WriteSubgroup or InitializeSubgroup
  // since, even one that failed); OK with nothing to do. Tiers whose record was
  // written before the failure and is unchanged are not written again, so
  // their previous record (the last commit every tier holds, if a crash
  // comes now) stays; a tier that holds a failed attempt's record has it
  // replaced, never moved to COMMIT.prev. FailedPrecondition during a step
  // or with a step that failed part-way pending.
  absl::Status RetryCommit();

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

namespace internal_engine {

// Test hook (process-wide; nullptr turns it off): the free bytes of the file
// system that holds the tier directory `path`, asked by Engine::Create in
// place of statvfs for tiers whose capacity_bytes is 0. Lets a test stand in
// a small file system (one that its own files fill up) for a real one.
using TierFreeBytesFn = uint64_t (*)(const std::string& path);
void SetTierFreeBytesForTesting(TierFreeBytesFn fn);
// The bytes allocated to `path` and, for a directory, to everything under
// it: what a fake file system holding only that directory has used.
uint64_t BytesUnderForTesting(const std::string& path);

}  // namespace internal_engine
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_MLP_OFFLOAD_ENGINE_H_
