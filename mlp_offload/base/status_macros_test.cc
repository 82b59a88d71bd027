#include "mlp_offload/base/status_macros.h"

#include <cerrno>

#include "gtest/gtest.h"

namespace mlp_offload {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status Quarter(int x, int* out) {
  MLP_ASSIGN_OR_RETURN(int h, Half(x));
  MLP_ASSIGN_OR_RETURN(*out, Half(h));
  MLP_RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, PropagatesErrorsAndValues) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  absl::Status s = Quarter(6, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd");
}

TEST(StatusMacrosTest, ErrnoStatusNamesOperationAndObject) {
  absl::Status s = ErrnoStatus(ENOSPC, "pwrite", "/x/sg3.bin at offset 4096");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("pwrite /x/sg3.bin at offset 4096"),
            std::string::npos);
  EXPECT_NE(s.message().find("No space left"), std::string::npos);
  EXPECT_EQ(ErrnoStatus(ENOENT, "open", "/nope").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Annotate(absl::InternalError("x"), "tier 1").message(),
            "tier 1: x");
}

}  // namespace
}  // namespace mlp_offload
