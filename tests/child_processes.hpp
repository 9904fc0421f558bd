// The live child processes of a process whose command line names a word: how tests find the `rlloop worker`
// ranks a service or a server started, to kill or stop them.
#pragma once
#include <sys/types.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace test_util {

inline std::vector<pid_t> child_processes(pid_t parent, const std::string& word) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close_paren = line.rfind(')');  // the command name before it may hold spaces
    if (close_paren == std::string::npos) continue;
    std::istringstream rest(line.substr(close_paren + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != parent || state == 'Z') continue;
    std::ifstream cmd(entry.path() / "cmdline");
    const std::string cmdline((std::istreambuf_iterator<char>(cmd)), std::istreambuf_iterator<char>());
    if (cmdline.find(word) != std::string::npos) out.push_back(std::stoi(name));
  }
  return out;
}

}  // namespace test_util
