// One of two ways of computing the same result (the same bits: only the speed differs), chosen by timing both once
// per process: each way run alternately `rounds` times, the least time of each compared. set() forces one instead.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>

namespace zoo {

class TimedChoice {
 public:
  // The way in use, 0 or 1: at the first call, way 0 where `both` is false (way 1 is not built), else the faster
  // under run(way), run = prepare() (its inputs made before the timing).
  int get(const std::function<std::function<void(int)>()>& prepare, bool both, int rounds = 7) {
    int chosen = chosen_.load();
    if (!chosen) {
      chosen = 1 + (both ? faster(prepare(), rounds) : 0);
      int expected = 0;
      if (!chosen_.compare_exchange_strong(expected, chosen)) chosen = expected;
    }
    return chosen - 1;
  }

  void set(int way) { chosen_.store(1 + way); }

 private:
  static int faster(const std::function<void(int)>& run, int rounds) {
    double least[2] = {1e30, 1e30};
    for (int round = 0; round < rounds; ++round) {
      for (int way = 0; way < 2; ++way) {
        const auto start = std::chrono::steady_clock::now();
        run(way);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        least[way] = std::min(least[way], seconds);
      }
    }
    return least[1] < least[0] ? 1 : 0;
  }

  std::atomic<int> chosen_{0};  // 0: not chosen yet; else 1 + the way in use
};

}  // namespace zoo
