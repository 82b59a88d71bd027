// One byte's open-file-description lock (fcntl F_OFD_SETLK / F_OFD_SETLKW):
// the tier lock's building block, shared with its benchmark.
#ifndef MLP_OFFLOAD_IO_INTERNAL_OFD_LOCK_H_
#define MLP_OFFLOAD_IO_INTERNAL_OFD_LOCK_H_

#include <fcntl.h>

#include <cerrno>
#include <cstring>

namespace mlp_offload {
namespace internal_io {

// Applies an OFD lock of `type` (F_RDLCK, F_WRLCK, F_UNLCK) to byte `offset`
// of `fd`'s file; `wait` sleeps until it is granted. Returns errno (0 on
// success; EAGAIN or EACCES: held by another, without `wait`).
inline int OfdLock(int fd, short type, off_t offset, bool wait) {
  struct flock fl;
  std::memset(&fl, 0, sizeof(fl));
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = offset;
  fl.l_len = 1;
  fl.l_pid = 0;  // required for OFD locks
  for (;;) {
    if (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) == 0) return 0;
    if (errno != EINTR) return errno;
  }
}

}  // namespace internal_io
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_INTERNAL_OFD_LOCK_H_
