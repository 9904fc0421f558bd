// Sub-command registry of the `rlloop` tool. Each cmd_<name>.cpp registers itself with a static
// RegisterCommand; main.cpp dispatches on argv[1]. A module adds a command by adding one file.
#pragma once
#include <string>
#include <vector>

namespace rlloop::cli {

struct Command {
  std::string name;
  std::string summary;
  // argv[0] is the sub-command name; returns the process exit code.
  int (*run)(int argc, char** argv);
};

std::vector<Command>& commands();

struct RegisterCommand {
  explicit RegisterCommand(Command c) { commands().push_back(std::move(c)); }
};

}  // namespace rlloop::cli
