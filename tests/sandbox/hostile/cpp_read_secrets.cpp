// Reads the host's secret file and /etc/shadow.
#include <cstdio>
#include <cstring>
#include <initializer_list>
int main() {
  int found = 0;
  for (const char* path : {"@HOST_DIR@/secret.txt", "/etc/shadow", "/root/.ssh/id_rsa"}) {
    if (std::FILE* f = std::fopen(path, "r")) {
      char buf[256] = {};
      found += std::fread(buf, 1, sizeof buf - 1, f) > 0;
      std::fclose(f);
    }
  }
  if (found) std::puts("PWNED");
}
