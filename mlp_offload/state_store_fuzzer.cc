// libFuzzer target for the parsers of untrusted on-disk metadata: record
// headers, manifests and commit records. A parser may reject its input, but
// never crash, hang or read out of bounds, and whatever it accepts must
// re-encode to something it accepts again with the same meaning.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "mlp_offload/state_store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mlp_offload;
  absl::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto h = DecodeRecordHeader(data, size, "fuzz"); h.ok()) {
    std::string page(kRecordHeaderBytes, '\0');
    EncodeRecordHeader(*h, page.data());
    auto again = DecodeRecordHeader(page.data(), page.size(), "fuzz");
    if (!again.ok() || again->step != h->step || again->numel != h->numel ||
        again->format_version != h->format_version ||
        again->payload_checksum != h->payload_checksum) {
      std::abort();
    }
  }
  if (auto m = ParseManifest(text, "fuzz"); m.ok()) {
    auto again = ParseManifest(EncodeManifest(*m), "fuzz");
    if (!again.ok() || again->subgroup_numel != m->subgroup_numel ||
        again->tier_of_subgroup != m->tier_of_subgroup ||
        again->format_version != m->format_version) {
      std::abort();
    }
    (void)CheckManifestMatches(*m, *again, "fuzz");
  }
  if (auto c = ParseCommitRecord(text, "fuzz"); c.ok()) {
    auto again = ParseCommitRecord(EncodeCommitRecord(*c), "fuzz");
    if (!again.ok() || again->subgroup_slot != c->subgroup_slot ||
        again->id != c->id ||
        again->subgroup_checksum != c->subgroup_checksum) {
      std::abort();
    }
  }
  return 0;
}
