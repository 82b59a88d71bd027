#include "io/aligned_buffer.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "gtest/gtest.h"

namespace mlp_offload {
namespace {

TEST(AlignedBufferTest, AlignedRoundedUpAndZeroed) {
  absl::StatusOr<AlignedBuffer> buffer = AlignedBuffer::Allocate(5000);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % kDirectIoAlignment,
            0u);
  EXPECT_EQ(buffer->size(), 8192u);
  for (size_t i = 0; i < buffer->size(); ++i) {
    ASSERT_EQ(buffer->as<unsigned char>()[i], 0) << i;
  }
  EXPECT_FALSE(buffer->pinned());
}

TEST(AlignedBufferTest, CustomAlignment) {
  absl::StatusOr<AlignedBuffer> buffer = AlignedBuffer::Allocate(1, 1 << 16);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % (1 << 16), 0u);
  EXPECT_EQ(buffer->size(), size_t{1} << 16);
}

TEST(AlignedBufferTest, RejectsBadAlignment) {
  EXPECT_EQ(AlignedBuffer::Allocate(100, 3000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AlignedBuffer::Allocate(100, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(AlignedBufferTest, HugeAllocationIsResourceExhausted) {
  EXPECT_EQ(AlignedBuffer::Allocate(SIZE_MAX - 10).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(AlignedBufferTest, MoveTransfersOwnership) {
  absl::StatusOr<AlignedBuffer> a = AlignedBuffer::Allocate(4096);
  ASSERT_TRUE(a.ok());
  void* data = a->data();
  AlignedBuffer b = std::move(*a);
  EXPECT_EQ(b.data(), data);
  EXPECT_TRUE(a->empty());
  AlignedBuffer c;
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(c.size(), 4096u);
}

int g_pinned = 0;
int g_unpinned = 0;
absl::Status FakePin(void* data, size_t bytes) {
  ++g_pinned;
  return absl::OkStatus();
}
void FakeUnpin(void* data, size_t bytes) { ++g_unpinned; }
absl::Status FailingPin(void* data, size_t bytes) {
  return absl::InternalError("cudaHostRegister failed");
}

TEST(AlignedBufferTest, PinningHooksPinAndUnpinOnce) {
  {
    absl::StatusOr<AlignedBuffer> unpinned =
        AlignedBuffer::AllocatePinned(4096);
    ASSERT_TRUE(unpinned.ok());
    EXPECT_FALSE(unpinned->pinned());  // no hooks installed
  }
  SetHostPinningHooks({&FakePin, &FakeUnpin});
  EXPECT_TRUE(HostPinningAvailable());
  {
    absl::StatusOr<AlignedBuffer> buffer = AlignedBuffer::AllocatePinned(4096);
    ASSERT_TRUE(buffer.ok());
    EXPECT_TRUE(buffer->pinned());
    AlignedBuffer moved = std::move(*buffer);
    EXPECT_TRUE(moved.pinned());
    AlignedBuffer plain = *AlignedBuffer::Allocate(4096);
    EXPECT_FALSE(plain.pinned());
  }
  EXPECT_EQ(g_pinned, 1);
  EXPECT_EQ(g_unpinned, 1);
  SetHostPinningHooks({&FailingPin, &FakeUnpin});
  absl::StatusOr<AlignedBuffer> failed = AlignedBuffer::AllocatePinned(4096);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(failed.status().message().find("cudaHostRegister"),
            std::string::npos);
  SetHostPinningHooks({});
  EXPECT_FALSE(HostPinningAvailable());
}

}  // namespace
}  // namespace mlp_offload
