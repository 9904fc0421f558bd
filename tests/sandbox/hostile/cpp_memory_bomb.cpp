// Allocates and touches memory until it has 8 GiB.
#include <cstdio>
#include <cstdlib>
#include <cstring>
int main() {
  std::size_t total = 0;
  for (int i = 0; i < 64; ++i) {
    void* p = std::malloc(128u << 20);
    if (!p) break;
    std::memset(p, 1, 128u << 20);
    total += 128u << 20;
  }
  if (total >= (std::size_t(8) << 30)) std::puts("PWNED");
}
