// Progress lines the examples print while they train.
#pragma once
#include <unistd.h>

#include <cstdio>
#include <string>

namespace rlloop::examples {

// A progress line rewritten in place on a terminal, printed every 10 steps otherwise (CI logs).
inline void progress(const char* phase, int step, int total, const std::string& detail) {
  const bool tty = ::isatty(STDERR_FILENO);
  if (!tty && step % 10 != 0 && step != total) return;
  const int width = 24, filled = total ? width * step / total : width;
  std::fprintf(stderr, "%s%-5s [%s%s] %3d/%-3d %s%s", tty ? "\r" : "", phase, std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), step, total, detail.c_str(), tty ? "   " : "\n");
  if (tty && step == total) std::fprintf(stderr, "\n");
}

// printf of up to two numbers into a string, for progress details ("loss %.3f").
inline std::string format(const char* f, double a, double b = 0) {
  char buf[128];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}

}  // namespace rlloop::examples
