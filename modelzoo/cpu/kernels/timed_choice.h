// One of several ways of computing the same result (the same bits: only the speed differs), chosen by timing them
// once per process: each way run in turn `rounds` times, the least time of each compared. set() forces one instead.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <vector>

namespace zoo {

class TimedChoice {
 public:
  // The way in use, 0 to ways - 1 (the ways built): at the first call, way 0 where it is the only one, else the
  // fastest under run(way), run = prepare() (its inputs made before the timing).
  int get(const std::function<std::function<void(int)>()>& prepare, int ways, int rounds = 7) {
    int chosen = chosen_.load();
    if (!chosen) {
      chosen = 1 + (ways > 1 ? fastest(prepare(), ways, rounds) : 0);
      int expected = 0;
      if (!chosen_.compare_exchange_strong(expected, chosen)) chosen = expected;
    }
    return chosen - 1;
  }

  void set(int way) { chosen_.store(1 + way); }

 private:
  static int fastest(const std::function<void(int)>& run, int ways, int rounds) {
    std::vector<double> least(ways, 1e30);
    for (int round = 0; round < rounds; ++round) {
      for (int way = 0; way < ways; ++way) {
        const auto start = std::chrono::steady_clock::now();
        run(way);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        least[way] = std::min(least[way], seconds);
      }
    }
    return static_cast<int>(std::min_element(least.begin(), least.end()) - least.begin());
  }

  std::atomic<int> chosen_{0};  // 0: not chosen yet; else 1 + the way in use
};

}  // namespace zoo
