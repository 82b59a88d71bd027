// ThreadSanitizer suppressions compiled into every test binary.
//
// Debian ships Abseil as uninstrumented shared libraries. absl::Status keeps
// its message and payloads in a heap block with an atomic reference count
// that is decremented inside libabsl_status.so, so TSan never sees the
// acquire/release pair that orders one thread's last read of a shared Status
// before another thread's final Unref and delete. It then reports that
// delete as racing with the earlier read, although the refcount orders them.
// Only reports with a Status::Unref / Status::UnrefNonInlined frame (the
// inline Unref tail-calls into the library, so either can be the frame above
// the delete) are suppressed: other races in project code, in the parts of
// Abseil compiled from headers, and in libstdc++ are still reported.
//
// libtsan defines this hook weakly; a strong definition must live in the
// executable itself (this library is linkstatic + alwayslink) to win the
// symbol lookup. In builds without TSan the function is simply unused.

extern "C" const char* __tsan_default_suppressions() {
  return "race:absl::*Status::Unref\n";
}
