// Entry point of the `rlloop` command-line tool.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string_view>

#include <rlloop/error.hpp>

#include "command.hpp"

namespace rlloop::cli {
std::vector<Command>& commands() {
  static std::vector<Command> all;
  return all;
}
}  // namespace rlloop::cli

namespace {
void print_usage() {
  auto cmds = rlloop::cli::commands();
  std::sort(cmds.begin(), cmds.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::printf("usage: rlloop <command> [options]   (rlloop <command> --help for details)\n\ncommands:\n");
  for (const auto& c : cmds) std::printf("  %-12s %s\n", c.name.c_str(), c.summary.c_str());
#ifdef RLLOOP_CLI_ENGINE_COMMANDS
  std::printf("\nleft out of this build (no LibTorch engine): %s\n", RLLOOP_CLI_ENGINE_COMMANDS);
#endif
}

#ifdef RLLOOP_CLI_ENGINE_COMMANDS
// A build without the engine leaves out the commands that drive a model (src/cli/CMakeLists.txt lists them): asked
// for one, the tool says why it is missing rather than that it does not exist.
bool is_engine_command(std::string_view name) {
  std::string_view rest = RLLOOP_CLI_ENGINE_COMMANDS;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    if (rest.substr(0, comma) == name) return true;
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
  }
  return false;
}
#endif
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    print_usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string_view name = argv[1];
  for (const auto& c : rlloop::cli::commands()) {
    if (c.name != name) continue;
    try {
      return c.run(argc - 1, argv + 1);
    } catch (const rlloop::error& e) {
      std::fprintf(stderr, "rlloop %s: %s\n", argv[1], e.what());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rlloop %s: unexpected error: %s\n", argv[1], e.what());
      return 1;
    }
  }
#ifdef RLLOOP_CLI_ENGINE_COMMANDS
  if (is_engine_command(name)) {
    std::fprintf(stderr,
                 "rlloop: '%s' needs the LibTorch engine, which this build leaves out (configured with "
                 "RLLOOP_WITH_TORCH=OFF); rebuild with it ON\n",
                 argv[1]);
    return 2;
  }
#endif
  std::fprintf(stderr, "rlloop: unknown command '%s'\n", argv[1]);
  print_usage();
  return 2;
}
