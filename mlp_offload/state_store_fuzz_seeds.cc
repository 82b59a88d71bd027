// Writes valid encodings of each format into a directory: the fuzzer's seed
// corpus, so it starts from inputs that pass the checksums.
#include <cstdio>
#include <string>

#include "mlp_offload/state_store.h"

int main(int argc, char** argv) {
  using namespace mlp_offload;
  if (argc != 2) return 2;
  std::string dir = argv[1];
  auto put = [&](const std::string& name, const std::string& bytes) {
    FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
    if (f == nullptr) return false;
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    return std::fclose(f) == 0;
  };
  RecordHeader h;
  h.run_id = 7;
  h.subgroup = 3;
  h.num_arrays = 3;
  h.numel = 100;
  h.step = 5;
  h.payload_bytes = 1200;
  std::string page(kRecordHeaderBytes, '\0');
  EncodeRecordHeader(h, page.data());
  // The oldest format still read, whose header checksum the fuzzer would
  // hardly find by mutation.
  std::string old_page(kRecordHeaderBytes, '\0');
  h.format_version = kOldestStateFormatVersion;
  EncodeRecordHeader(h, old_page.data());
  Manifest m;
  m.run_id = 9;
  m.arrays_per_param = 3;
  m.subgroup_numel = {10, 20, 30};
  m.tier_of_subgroup = {0, 1, 0};
  CommitRecord c;
  c.id = {5, 4};
  c.subgroup_checksum = {7, 0, 9};
  c.subgroup_step = {4, -1, 4};
  c.subgroup_slot = {0, 0, 1};
  Manifest old_m = m;
  old_m.format_version = kOldestStateFormatVersion;
  bool ok = put("header", page.substr(0, 128)) &&
            put("header_oldest_format", old_page.substr(0, 128)) &&
            put("manifest_oldest_format", EncodeManifest(old_m)) &&
            put("manifest", EncodeManifest(m)) &&
            put("commit", EncodeCommitRecord(c));
  return ok ? 0 : 1;
}
