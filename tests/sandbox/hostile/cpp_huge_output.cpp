// Floods stdout after the expected answer.
#include <cstdio>
int main() {
  std::puts("PWNED");
  static char buf[65536];
  for (auto& c : buf) c = 'x';
  for (;;) std::fwrite(buf, 1, sizeof buf, stdout);
}
