// rlloop::sandbox: language names parse as documented, and bad ones are refused by name.
#include <cstdio>

#include <rlloop/error.hpp>
#include <rlloop/sandbox.hpp>

int main() {
  namespace sb = rlloop::sandbox;
  bool refused = false;
  try {
    sb::parse_language("cobol");
  } catch (const rlloop::invalid_argument&) {
    refused = true;
  }
  const bool ok = sb::parse_language("py") == sb::Language::python && sb::to_string(sb::Outcome::timeout) == "timeout";
  std::printf("sandbox: %s\n", ok && refused ? "ok" : "wrong");
  return ok && refused ? 0 : 1;
}
