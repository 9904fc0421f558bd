// Spawns threads until it cannot; PWNED if it got any.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
int main() {
  std::vector<std::thread> ts;
  try {
    for (int i = 0; i < 100000; ++i) ts.emplace_back([] { std::this_thread::sleep_for(std::chrono::hours(1)); });
  } catch (...) {
  }
  if (!ts.empty()) std::puts("PWNED");
  std::fflush(stdout);
  std::_Exit(0);
}
