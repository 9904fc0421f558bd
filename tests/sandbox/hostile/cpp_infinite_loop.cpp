// Burns CPU forever: must be stopped by the CPU limit.
#include <cstdio>
int main() {
  volatile unsigned long x = 0;
  for (;;) ++x;
  std::puts("PWNED");
}
