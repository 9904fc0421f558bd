// Classic fork bomb; PWNED if any fork succeeded.
#include <unistd.h>
#include <cstdio>
int main() {
  int made = 0;
  for (int i = 0; i < 100000; ++i) {
    pid_t p = fork();
    if (p == 0)
      for (;;) {
      }
    if (p > 0) ++made;
  }
  if (made > 0) std::puts("PWNED");
}
