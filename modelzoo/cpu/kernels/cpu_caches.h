// This core's cache sizes as the system reports them (sysconf), each read once; a typical size where it does not say.
// The kernels size what they keep or fetch ahead by them: the attention's next task, the AMX GEMM's row groups.
#pragma once

#include <unistd.h>

#include <cstdint>

namespace zoo {

// The bytes of sysconf's cache `name`, or `fallback` where the system does not say.
inline int64_t reported_cache_bytes(int name, int64_t fallback) {
  const long reported = sysconf(name);
  return reported > 0 ? static_cast<int64_t>(reported) : fallback;
}

// The L2 cache per core (1 MiB where the system does not say).
inline int64_t l2_cache_bytes() {
  static const int64_t bytes = reported_cache_bytes(_SC_LEVEL2_CACHE_SIZE, int64_t{1} << 20);
  return bytes;
}

}  // namespace zoo
