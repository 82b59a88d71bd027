// Header, manifest and commit-record formats; atomic small-file writes.
#include "mlp_offload/state_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/checksum.h"
#include "mlp_offload/base/status_macros.h"

namespace mlp_offload {
namespace {

constexpr uint64_t kHeaderMagic = 0x54534f504c4d0a31ull;  // "1\nMLPOST" (LE)
// Commit records before epochs (parsed as epoch 0), and now.
constexpr uint64_t kCommitMagicV1 = 0x54494d4d4f434c4dull;  // "MLCOMMIT"
constexpr uint64_t kCommitMagic = 0x3254494d4f434c4dull;    // "MLCOMIT2"
constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ull;

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t Round(uint64_t acc, uint64_t v) {
  acc += v * kPrime2;
  acc = Rotl(acc, 31);
  return acc * kPrime1;
}
inline uint64_t Mix(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

// Four independent lanes (so the multiplies pipeline), then the tail bytes.
uint64_t HashChunk(const unsigned char* p, size_t n, uint64_t seed) {
  uint64_t a = seed + kPrime1 + kPrime2, b = seed + kPrime2, c = seed,
           d = seed - kPrime1;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t v[4];
    std::memcpy(v, p + i, 32);
    a = Round(a, v[0]);
    b = Round(b, v[1]);
    c = Round(c, v[2]);
    d = Round(d, v[3]);
  }
  uint64_t h = Rotl(a, 1) + Rotl(b, 7) + Rotl(c, 12) + Rotl(d, 18) + n;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    h = Rotl(h ^ Round(0, v), 27) * kPrime1 + kPrime3;
  }
  for (; i < n; ++i) h = Rotl(h ^ (p[i] * kPrime3), 11) * kPrime1;
  return Mix(h);
}

struct HeaderLayout {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint64_t run_id;
  uint32_t subgroup;
  uint32_t num_arrays;
  uint64_t numel;
  int64_t step;
  uint64_t payload_bytes;
  uint64_t payload_checksum;
  uint64_t header_checksum;  // of the bytes above
};

// PayloadChecksum hashes fixed chunks (chunk c seeded with c), then the
// chunks' hashes in order, seeded with the payload's size; with HashChunk in
// format 1, StripeHash64 from format 2.
uint64_t FormatHash(const void* data, size_t len, uint64_t seed,
                    uint32_t format_version) {
  switch (format_version) {
    case 1:
      return HashChunk(static_cast<const unsigned char*>(data), len, seed);
    case 2:
      return StripeHash64(data, len, seed);
    default:
      // Headers and manifests of other versions are refused as they are
      // decoded: one here is a bug of the caller's, and no checksum of an
      // unknown format can be right.
      std::abort();
  }
}

uint64_t ChunkHash(const void* data, size_t len, size_t c,
                   uint32_t format_version) {
  return FormatHash(data, len, c, format_version);
}

uint64_t CombineChunkHashes(const std::vector<uint64_t>& parts, uint64_t n,
                            uint32_t format_version) {
  return FormatHash(parts.data(), parts.size() * sizeof(uint64_t), n,
                    format_version);
}

// What an unreadable version's error adds: the versions this build reads,
// and who writes newer ones.
std::string FormatsReadHint(uint64_t version) {
  return absl::StrCat(" (this build reads ", kOldestStateFormatVersion, " to ",
                      kStateFormatVersion,
                      version > kStateFormatVersion
                          ? "; a newer build of MLP-Offload wrote it)"
                          : ")");
}

bool ReadableFormat(uint64_t version) {
  return version >= kOldestStateFormatVersion && version <= kStateFormatVersion;
}

}  // namespace

uint64_t PayloadChecksum(const void* data, size_t n, ThreadPool* pool,
                         uint32_t format_version) {
  return PayloadChecksumVisiting(data, n, pool, nullptr, format_version);
}

uint64_t PayloadChecksumVisiting(
    const void* data, size_t n, ThreadPool* pool,
    const std::function<void(size_t begin, size_t length)>& visit,
    uint32_t format_version) {
  const size_t chunks = (n + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
  std::vector<uint64_t> parts(chunks);
  auto body = [&](size_t c) {
    size_t begin = c * kChecksumChunkBytes,
           len = std::min(kChecksumChunkBytes, n - begin);
    if (visit) visit(begin, len);
    parts[c] = ChunkHash(static_cast<const char*>(data) + begin, len, c,
                         format_version);
  };
  if (pool != nullptr) {
    pool->ParallelFor(chunks, body);
  } else {
    for (size_t c = 0; c < chunks; ++c) body(c);
  }
  return CombineChunkHashes(parts, n, format_version);
}

void EncodeRecordHeader(const RecordHeader& h, void* page) {
  std::memset(page, 0, kRecordHeaderBytes);
  HeaderLayout l{};
  l.magic = kHeaderMagic;
  l.version = h.format_version;
  l.header_bytes = kRecordHeaderBytes;
  l.run_id = h.run_id;
  l.subgroup = h.subgroup;
  l.num_arrays = h.num_arrays;
  l.numel = h.numel;
  l.step = h.step;
  l.payload_bytes = h.payload_bytes;
  l.payload_checksum = h.payload_checksum;
  l.header_checksum = HashChunk(reinterpret_cast<const unsigned char*>(&l),
                                offsetof(HeaderLayout, header_checksum), 0);
  std::memcpy(page, &l, sizeof(l));
}

absl::StatusOr<RecordHeader> DecodeRecordHeader(const void* page, size_t size,
                                                absl::string_view where) {
  if (size < sizeof(HeaderLayout)) {
    return absl::DataLossError(
        absl::StrCat(where, ": header truncated (", size, " bytes)"));
  }
  HeaderLayout l;
  std::memcpy(&l, page, sizeof(l));
  if (l.magic != kHeaderMagic) {
    return absl::DataLossError(
        absl::StrCat(where, ": not an MLP-Offload state record (bad magic)"));
  }
  uint64_t sum = HashChunk(reinterpret_cast<const unsigned char*>(&l),
                           offsetof(HeaderLayout, header_checksum), 0);
  if (sum != l.header_checksum) {
    return absl::DataLossError(
        absl::StrCat(where, ": header checksum mismatch"));
  }
  if (!ReadableFormat(l.version) || l.header_bytes != kRecordHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat(where, ": unsupported state format version ", l.version,
                     FormatsReadHint(l.version)));
  }
  if (l.payload_bytes != l.numel * 4ull * l.num_arrays) {
    return absl::DataLossError(
        absl::StrCat(where, ": inconsistent header sizes"));
  }
  RecordHeader h;
  h.run_id = l.run_id;
  h.subgroup = l.subgroup;
  h.num_arrays = l.num_arrays;
  h.numel = l.numel;
  h.step = l.step;
  h.payload_bytes = l.payload_bytes;
  h.payload_checksum = l.payload_checksum;
  h.format_version = l.version;
  return h;
}

std::string EncodeManifest(const Manifest& m) {
  std::string out =
      absl::StrCat("mlp_offload_manifest ", m.format_version, "\n", "run_id ",
                   m.run_id, "\n", "arrays_per_param ", m.arrays_per_param,
                   "\n", "subgroups ", m.subgroup_numel.size(), "\n");
  for (size_t i = 0; i < m.subgroup_numel.size(); ++i) {
    absl::StrAppend(&out, i, " ", m.subgroup_numel[i], " ",
                    m.tier_of_subgroup[i], "\n");
  }
  uint64_t sum = HashChunk(reinterpret_cast<const unsigned char*>(out.data()),
                           out.size(), 0);
  absl::StrAppend(&out, "checksum ", sum, "\n");
  return out;
}

absl::StatusOr<Manifest> ParseManifest(absl::string_view text,
                                       absl::string_view where) {
  auto bad = [&](absl::string_view why) {
    return absl::DataLossError(
        absl::StrCat(where, ": corrupt manifest: ", why));
  };
  size_t cut = text.rfind("checksum ");
  if (cut == absl::string_view::npos || (cut > 0 && text[cut - 1] != '\n')) {
    return bad("no checksum line");
  }
  uint64_t want;
  absl::string_view sum_text = absl::StripSuffix(text.substr(cut + 9), "\n");
  if (!absl::SimpleAtoi(sum_text, &want)) return bad("bad checksum line");
  if (HashChunk(reinterpret_cast<const unsigned char*>(text.data()), cut, 0) !=
      want) {
    return bad("checksum mismatch");
  }
  std::vector<absl::string_view> lines =
      absl::StrSplit(text.substr(0, cut), '\n', absl::SkipEmpty());
  Manifest m;
  auto field = [&](size_t idx, absl::string_view key, auto* value) -> bool {
    if (idx >= lines.size()) return false;
    std::vector<absl::string_view> kv = absl::StrSplit(lines[idx], ' ');
    return kv.size() == 2 && kv[0] == key && absl::SimpleAtoi(kv[1], value);
  };
  uint64_t count = 0;
  if (!field(0, "mlp_offload_manifest", &m.format_version))
    return bad("bad first line");
  if (!ReadableFormat(m.format_version)) {
    return absl::DataLossError(
        absl::StrCat(where, ": unsupported manifest version ", m.format_version,
                     FormatsReadHint(m.format_version)));
  }
  if (!field(1, "run_id", &m.run_id) ||
      !field(2, "arrays_per_param", &m.arrays_per_param) ||
      !field(3, "subgroups", &count)) {
    return bad("missing header fields");
  }
  // The engine's limits (1 + at most 8 state arrays; records below 2^62
  // bytes), so no size computed from a manifest can wrap or be absurd.
  if (m.arrays_per_param < 1 || m.arrays_per_param > 9)
    return bad(absl::StrCat("arrays_per_param ", m.arrays_per_param,
                            " is not in [1, 9]"));
  if (count != lines.size() - 4)
    return bad("subgroup count does not match the lines");
  for (uint64_t i = 0; i < count; ++i) {
    std::vector<absl::string_view> parts = absl::StrSplit(lines[4 + i], ' ');
    uint64_t index, numel;
    int tier;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &index) ||
        index != i || !absl::SimpleAtoi(parts[1], &numel) ||
        !absl::SimpleAtoi(parts[2], &tier) || tier < 0 ||
        numel > (uint64_t{1} << 62) / (4 * m.arrays_per_param)) {
      return bad(absl::StrCat("bad subgroup line ", i));
    }
    m.subgroup_numel.push_back(numel);
    m.tier_of_subgroup.push_back(tier);
  }
  return m;
}

absl::Status CheckManifestMatches(const Manifest& expected,
                                  const Manifest& found,
                                  absl::string_view where) {
  if (expected.arrays_per_param != found.arrays_per_param) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, " holds state with ", found.arrays_per_param,
                     " arrays per parameter, this optimizer needs ",
                     expected.arrays_per_param, " (another optimizer?)"));
  }
  if (expected.subgroup_numel.size() != found.subgroup_numel.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, " holds ", found.subgroup_numel.size(),
                     " subgroups, this model has ",
                     expected.subgroup_numel.size(), " (another model?)"));
  }
  for (size_t i = 0; i < expected.subgroup_numel.size(); ++i) {
    if (expected.subgroup_numel[i] != found.subgroup_numel[i]) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": subgroup ", i, " has ", found.subgroup_numel[i],
          " parameters, this model's has ", expected.subgroup_numel[i],
          " (another model?)"));
    }
  }
  return absl::OkStatus();
}

std::string DescribeCommit(const CommitId& id) {
  return absl::StrCat("step ", id.step, " (epoch ", id.epoch, ")");
}

std::string EncodeCommitRecord(const CommitRecord& c) {
  std::string out;
  auto put = [&out](const void* p, size_t n) {
    out.append(static_cast<const char*>(p), n);
  };
  uint64_t magic = kCommitMagic, count = c.subgroup_step.size();
  std::vector<uint64_t> sums = c.subgroup_checksum;
  sums.resize(count, 0);
  put(&magic, 8);
  put(&c.id.epoch, 8);
  put(&c.id.step, 8);
  put(&count, 8);
  put(c.subgroup_step.data(), count * 8);
  put(sums.data(), count * 8);
  put(c.subgroup_slot.data(), count);
  uint64_t sum = HashChunk(reinterpret_cast<const unsigned char*>(out.data()),
                           out.size(), 1);
  put(&sum, 8);
  return out;
}

absl::StatusOr<CommitRecord> ParseCommitRecord(absl::string_view bytes,
                                               absl::string_view where) {
  auto bad = [&](absl::string_view why) {
    return absl::DataLossError(
        absl::StrCat(where, ": corrupt commit record: ", why));
  };
  if (bytes.size() < 32) return bad("truncated");
  uint64_t magic, count, sum;
  CommitRecord c;
  std::memcpy(&magic, bytes.data(), 8);
  if (magic != kCommitMagic && magic != kCommitMagicV1) return bad("bad magic");
  // The first format had no epoch (its records are of epoch 0) and no
  // checksums (0: not known).
  const bool v1 = magic == kCommitMagicV1;
  const size_t fixed = v1 ? 32 : 40, per = v1 ? 9 : 17;
  if (bytes.size() < fixed) return bad("truncated");
  const char* p = bytes.data() + 8;
  if (!v1) {
    std::memcpy(&c.id.epoch, p, 8);
    p += 8;
  }
  std::memcpy(&c.id.step, p, 8);
  std::memcpy(&count, p + 8, 8);
  p += 16;
  if (count > (bytes.size() - fixed) / per ||
      bytes.size() != fixed + count * per)
    return bad("bad size");
  std::memcpy(&sum, bytes.data() + bytes.size() - 8, 8);
  if (HashChunk(reinterpret_cast<const unsigned char*>(bytes.data()),
                bytes.size() - 8, 1) != sum) {
    return bad("checksum mismatch");
  }
  if (c.id.epoch < 0 || c.id.step < 0) return bad("negative step or epoch");
  c.subgroup_step.resize(count);
  c.subgroup_checksum.assign(count, 0);
  c.subgroup_slot.resize(count);
  std::memcpy(c.subgroup_step.data(), p, count * 8);
  p += count * 8;
  if (!v1) {
    std::memcpy(c.subgroup_checksum.data(), p, count * 8);
    p += count * 8;
  }
  std::memcpy(c.subgroup_slot.data(), p, count);
  for (uint8_t s : c.subgroup_slot) {
    if (s > 1) return bad("slot out of range");
  }
  return c;
}

absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents, bool durable) {
  std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(tmp.c_str(),
                O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, "open", tmp);
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t w = write(fd, contents.data() + done, contents.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      close(fd);
      unlink(tmp.c_str());
      return ErrnoStatus(e, "write", tmp);
    }
    done += static_cast<size_t>(w);
  }
  if (durable && fsync(fd) != 0) {
    int e = errno;
    close(fd);
    unlink(tmp.c_str());
    return ErrnoStatus(e, "fsync", tmp);
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    unlink(tmp.c_str());
    return ErrnoStatus(e, "rename", absl::StrCat(tmp, " to ", path));
  }
  if (!durable) return absl::OkStatus();
  // The rename is durable only once the directory's entry is: a crash
  // before that may bring the old file back.
  return SyncDirectory(ParentDirectory(path));
}

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open directory", dir);
  if (fsync(fd) != 0) {
    const int e = errno;
    close(fd);
    return ErrnoStatus(e, "fsync directory", dir);
  }
  close(fd);
  return absl::OkStatus();
}

std::string ParentDirectory(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path,
                                          size_t max_bytes) {
  // O_NONBLOCK: a FIFO planted there would block the open (and the reads)
  // for a writer; it is refused below.
  int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoStatus(errno, "open", path);
  absl::Status regular = CheckRegularFile(fd, path);
  if (!regular.ok()) {
    close(fd);
    return regular;
  }
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t r = read(fd, buf, sizeof(buf));
    if (r < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      close(fd);
      return ErrnoStatus(e, "read", path);
    }
    if (r == 0) break;
    if (out.size() + static_cast<size_t>(r) > max_bytes) {
      close(fd);
      return absl::DataLossError(
          absl::StrCat(path, " is larger than ", max_bytes,
                       " bytes, more than a run's metadata file can be: "
                       "it is damaged or not this run's"));
    }
    out.append(buf, static_cast<size_t>(r));
  }
  close(fd);
  return out;
}

absl::Status ReadFileAt(int fd, void* data, size_t n, uint64_t offset,
                        const std::string& path) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = pread(fd, static_cast<char*>(data) + done, n - done,
                      static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      return ErrnoStatus(errno, absl::StrCat("pread at offset ", offset + done),
                         path);
    }
    if (r == 0) {
      return absl::DataLossError(
          absl::StrCat(path, ": truncated (ends at byte ", offset + done,
                       ", expected ", offset + n, ")"));
    }
    done += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::Status WriteFileAt(int fd, const void* data, size_t n, uint64_t offset,
                         const std::string& path) {
  size_t done = 0;
  while (done < n) {
    ssize_t w = pwrite(fd, static_cast<const char*>(data) + done, n - done,
                       static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      return ErrnoStatus(
          errno, absl::StrCat("pwrite at offset ", offset + done), path);
    }
    if (w == 0) {
      return absl::DataLossError(
          absl::StrCat("pwrite wrote nothing to ", path));
    }
    done += static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

std::string ResolveCheckpointDir(const std::string& dir) {
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0 && lstat((dir + ".old").c_str(), &st) == 0) {
    return dir + ".old";
  }
  return dir;
}

absl::StatusOr<Manifest> ReadCheckpointManifest(const std::string& dir) {
  const std::string path = ResolveCheckpointDir(dir) + "/MANIFEST";
  MLP_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path));
  return ParseManifest(text, path);
}

absl::Status CheckCheckpointRecordHeader(const RecordHeader& h, int subgroup,
                                         uint64_t numel, uint32_t arrays,
                                         const std::string& path) {
  if (h.subgroup == static_cast<uint32_t>(subgroup) && h.numel == numel &&
      h.num_arrays == arrays && h.payload_bytes == numel * 4ull * arrays) {
    return absl::OkStatus();
  }
  return absl::DataLossError(absl::StrCat(
      path, ": the header says subgroup ", h.subgroup, " of ", h.numel,
      " parameters and ", h.num_arrays, " arrays, the manifest subgroup ",
      subgroup, " of ", numel, " and ", arrays));
}

absl::Status ReadCheckpointRecord(const std::string& dir_in, int subgroup,
                                  uint64_t want_numel, float* master,
                                  const std::vector<float*>& state, bool verify,
                                  int64_t* step) {
  const std::string dir = ResolveCheckpointDir(dir_in);
  MLP_ASSIGN_OR_RETURN(Manifest m, ReadCheckpointManifest(dir));
  if (subgroup < 0 ||
      static_cast<size_t>(subgroup) >= m.subgroup_numel.size()) {
    return absl::OutOfRangeError(
        absl::StrCat(dir, " holds ", m.subgroup_numel.size(),
                     " subgroups: there is no subgroup ", subgroup));
  }
  if (m.arrays_per_param < 1 || state.size() + 1 > m.arrays_per_param) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, " holds ", m.arrays_per_param, " arrays per parameter (master ",
        "and state): ", state.size(), " state arrays were asked for"));
  }
  const uint64_t numel = m.subgroup_numel[subgroup];
  if (numel != want_numel) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": subgroup ", subgroup, " holds ", numel,
        " parameters, the reader expects ", want_numel,
        " (the checkpoint's layout does not match its engine files)"));
  }
  const uint64_t payload = numel * 4ull * m.arrays_per_param;
  const std::string path = absl::StrCat(dir, "/sg_", subgroup, ".ckpt");
  int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open", path);
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  // The whole record is there, also where only the header is read (a
  // reader's check before it changes anything: a record cut short is found
  // then, not part-way through a load).
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", path);
  if (static_cast<uint64_t>(st.st_size) < kRecordHeaderBytes + payload) {
    return absl::DataLossError(absl::StrCat(
        path, ": truncated, ", st.st_size, " bytes where its record needs ",
        kRecordHeaderBytes + payload, " (cut short)"));
  }

  std::vector<char> page(kRecordHeaderBytes);
  MLP_RETURN_IF_ERROR(ReadFileAt(fd, page.data(), page.size(), 0, path));
  MLP_ASSIGN_OR_RETURN(RecordHeader h,
                       DecodeRecordHeader(page.data(), page.size(), path));
  MLP_RETURN_IF_ERROR(CheckCheckpointRecordHeader(h, subgroup, numel,
                                                  m.arrays_per_param, path));
  // Where each byte of the payload goes: array a (0 = master) covers
  // [a * numel * 4, (a + 1) * numel * 4).
  std::vector<char*> dest(m.arrays_per_param, nullptr);
  dest[0] = reinterpret_cast<char*>(master);
  for (size_t k = 0; k < state.size(); ++k) {
    dest[k + 1] = reinterpret_cast<char*>(state[k]);
  }
  const uint64_t array_bytes = numel * 4ull;
  if (!verify) {
    // Only the arrays asked for, straight into their destinations.
    for (uint64_t a = 0; a < dest.size(); ++a) {
      if (dest[a] == nullptr) continue;
      MLP_RETURN_IF_ERROR(
          ReadFileAt(fd, dest[a], static_cast<size_t>(array_bytes),
                     kRecordHeaderBytes + a * array_bytes, path));
    }
    if (step != nullptr) *step = h.step;
    return absl::OkStatus();
  }
  std::vector<char> chunk(std::min<uint64_t>(kChecksumChunkBytes, payload));
  std::vector<uint64_t> parts;
  parts.reserve((payload + kChecksumChunkBytes - 1) / kChecksumChunkBytes);
  for (uint64_t begin = 0; begin < payload; begin += kChecksumChunkBytes) {
    const size_t len = static_cast<size_t>(
        std::min<uint64_t>(kChecksumChunkBytes, payload - begin));
    MLP_RETURN_IF_ERROR(
        ReadFileAt(fd, chunk.data(), len, kRecordHeaderBytes + begin, path));
    parts.push_back(
        ChunkHash(chunk.data(), len, parts.size(), h.format_version));
    // Scatter [begin, begin + len) over the arrays it spans.
    for (uint64_t at = begin; at < begin + len;) {
      const uint64_t a = at / array_bytes;
      const uint64_t end = std::min(begin + len, (a + 1) * array_bytes);
      if (dest[a] != nullptr) {
        std::memcpy(dest[a] + (at - a * array_bytes),
                    chunk.data() + (at - begin), static_cast<size_t>(end - at));
      }
      at = end;
    }
  }
  if (CombineChunkHashes(parts, payload, h.format_version) !=
      h.payload_checksum) {
    return absl::DataLossError(absl::StrCat(
        path, ": payload checksum mismatch (subgroup ", subgroup, ")"));
  }
  if (step != nullptr) *step = h.step;
  return absl::OkStatus();
}

}  // namespace mlp_offload
