// Tries to create files outside its private tmp, including a world-writable host folder.
#include <cstdio>
int main() {
  const char* targets[] = {"@HOST_DIR@/pwned_cpp", "/usr/pwned_cpp", "/etc/pwned_cpp",
                           "/root/pwned_cpp",      "/pwned_cpp",     "/box/pwned_cpp",
                           "/var/tmp/pwned_cpp",   "/dev/pwned_cpp", "/dev/shm/pwned_cpp"};
  int ok = 0;
  for (const char* t : targets) {
    if (std::FILE* f = std::fopen(t, "w")) {
      ok += std::fputs("pwned", f) >= 0;
      std::fclose(f);
    }
  }
  if (ok) std::puts("PWNED");
}
