// Code grading in the sandbox, its hostile half (problems_test.cpp is the other): every program in
// tests/sandbox/hostile/ ends the way the sandbox's defences make it end, as a failure, leaves no process behind
// and changes nothing outside its sandbox.
//
// Each program is graded against a one-test problem expecting "PWNED", which it prints only if its attack
// worked, so a failing score means the attack failed.
#include <gtest/gtest.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <oneapi/tbb/global_control.h>

#include <rlloop/rewards/batch.hpp>
#include <rlloop/rewards/code.hpp>

namespace fs = std::filesystem;
using namespace rlloop;
using namespace rlloop::rewards;

namespace {
std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
}

// Children of any of our threads: a process that escaped its sandbox would be re-parented to us (subreaper).
std::vector<std::string> our_children() {
  std::vector<std::string> kids;
  for (const auto& task : fs::directory_iterator("/proc/self/task")) {
    std::string c = read_file(task.path() / "children");
    if (c.find_first_not_of(" \n") != std::string::npos) kids.push_back(c);
  }
  return kids;
}
}  // namespace

TEST(Hostile, EveryProgramFailsHarmlessly) {
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  // Sandboxed runs mostly wait; let more of them run at once than there are cores.
  tbb::global_control parallelism(tbb::global_control::max_allowed_parallelism, 8);

  const std::string tag = std::to_string(::getpid());
  const std::string secret = "rlloop-secret-" + tag + "-d41d8cd98f";
  // A world-writable host folder with a world-readable secret: only the sandbox keeps programs out.
  const fs::path host_dir = fs::path(RLLOOP_BINARY_DIR) / ("hostile-target-" + tag);
  fs::remove_all(host_dir);
  fs::create_directories(host_dir);
  fs::permissions(host_dir, fs::perms::all);
  { std::ofstream(host_dir / "secret.txt") << secret; }
  fs::permissions(host_dir / "secret.txt",
                  fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
  ::setenv("RLLOOP_HOSTILE_SECRET", secret.c_str(), 1);
  const fs::path scratch = fs::path("/tmp") / ("rlloop-hostile-scratch-" + tag);
  fs::create_directories(scratch);

  std::vector<CodeProblem> problems;
  std::vector<std::string> sources;
  for (const auto& e : fs::directory_iterator(fs::path(RLLOOP_SOURCE_DIR) / "tests/sandbox/hostile")) {
    const auto ext = e.path().extension();
    if (ext != ".py" && ext != ".cpp") continue;
    CodeProblem p;
    p.task_id = e.path().filename().string();
    p.language = ext == ".py" ? sandbox::Language::python : sandbox::Language::cpp;
    p.tests = {{"", "PWNED"}};
    std::string src = read_file(e.path());
    replace_all(src, "@HOST_DIR@", host_dir.string());
    replace_all(src, "@SECRET@", secret);
    problems.push_back(std::move(p));
    sources.push_back(std::move(src));
  }
  ASSERT_GE(problems.size(), 15u);

  // How each attack ends once the sandbox stops it. The ones that would run forever are killed by their limit
  // (timeout: CPU or wall clock; output_limit); the others run to their end and, defended against, print
  // nothing (wrong_answer) or fail (runtime_error); the compile-time one does not compile. An attack that got
  // further, or a run that outlived its kill (an escaped process holding its pipes), would end another way.
  const std::map<std::string, ScoreStatus> expected = {
      {"cpp_fork_bomb.cpp", ScoreStatus::wrong_answer},
      {"cpp_huge_output.cpp", ScoreStatus::output_limit},
      {"cpp_include_secret.cpp", ScoreStatus::compile_error},
      {"cpp_infinite_loop.cpp", ScoreStatus::timeout},
      {"cpp_memory_bomb.cpp", ScoreStatus::wrong_answer},
      {"cpp_read_secrets.cpp", ScoreStatus::wrong_answer},
      {"cpp_socket.cpp", ScoreStatus::runtime_error},
      {"cpp_thread_bomb.cpp", ScoreStatus::wrong_answer},
      {"cpp_write_outside.cpp", ScoreStatus::wrong_answer},
      {"py_daemon_escape.py", ScoreStatus::wrong_answer},
      {"py_disk_fill.py", ScoreStatus::wrong_answer},
      {"py_fork_bomb.py", ScoreStatus::wrong_answer},
      {"py_huge_output.py", ScoreStatus::output_limit},
      {"py_infinite_loop.py", ScoreStatus::timeout},
      {"py_memory_bomb.py", ScoreStatus::wrong_answer},
      {"py_proc_snoop.py", ScoreStatus::wrong_answer},
      {"py_read_secrets.py", ScoreStatus::wrong_answer},
      {"py_sleep_forever.py", ScoreStatus::timeout},
      {"py_socket.py", ScoreStatus::wrong_answer},
      {"py_write_outside.py", ScoreStatus::wrong_answer},
  };
  // Only the programs that would run forever meet a CPU or wall-clock limit, so only they run under tight ones
  // (their ending, timeout, does not depend on the machine's load). Every other program ends by itself; its
  // limits are generous so that a loaded machine (a build beside the tests) cannot turn its ending into a
  // timeout: the memory bomb's page faults alone cost it near a CPU second there.
  auto reward_with = [&](double cpu_seconds, double wall_seconds) {
    CodeRewardOptions opts;
    opts.limits.cpu_seconds = cpu_seconds;
    opts.limits.wall_seconds = wall_seconds;
    opts.limits.output_bytes = 64 << 10;
    const auto sb = std::make_shared<const sandbox::Sandbox>(sandbox::Options{.scratch_root = scratch.string()});
    return CodeReward(sb, opts);
  };
  const CodeReward stopped = reward_with(1, 3), finishing = reward_with(20, 60);
  std::vector<CodeGrade> grades(problems.size());
  rewards::detail::parallel_indices(problems.size(), {}, [&](std::size_t i) {
    const auto want = expected.find(problems[i].task_id);
    const bool runs_forever = want != expected.end() && want->second == ScoreStatus::timeout;
    grades[i] = (runs_forever ? stopped : finishing).grade(problems[i], sources[i]);
  });

  EXPECT_EQ(problems.size(), expected.size()) << "every program in tests/sandbox/hostile/ needs its expected ending";
  for (std::size_t i = 0; i < problems.size(); ++i) {
    const auto& g = grades[i];
    SCOPED_TRACE(problems[i].task_id + ": " + std::string(to_string(g.score.status)) + " — " + g.score.details);
    std::printf("  %-24s %-14s %s\n", problems[i].task_id.c_str(), std::string(to_string(g.score.status)).c_str(),
                g.score.details.substr(0, 90).c_str());
    EXPECT_EQ(g.score.value, 0.0);
    const auto want = expected.find(problems[i].task_id);
    if (want == expected.end())
      ADD_FAILURE() << "no expected ending for " << problems[i].task_id;
    else
      EXPECT_EQ(g.score.status, want->second);
    EXPECT_EQ(g.score.details.find(secret), std::string::npos);
  }

  // Nothing left running: escaped processes would have been re-parented to this process.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  while (::waitpid(-1, nullptr, WNOHANG) > 0) {
  }
  EXPECT_TRUE(our_children().empty()) << "leftover processes: " << our_children().front();

  // Nothing changed outside: the host folder holds only the secret, no marker anywhere, scratch boxes removed.
  std::vector<std::string> in_host_dir;
  for (const auto& e : fs::directory_iterator(host_dir)) in_host_dir.push_back(e.path().filename().string());
  EXPECT_EQ(in_host_dir, std::vector<std::string>{"secret.txt"});
  EXPECT_EQ(read_file(host_dir / "secret.txt"), secret);
  for (const char* p :
       {"/usr/pwned_py", "/etc/pwned_py", "/root/pwned_py", "/pwned_py", "/var/tmp/pwned_py", "/home/pwned_py",
        "/usr/pwned_cpp", "/etc/pwned_cpp", "/root/pwned_cpp", "/pwned_cpp", "/var/tmp/pwned_cpp", "/dev/pwned_cpp",
        "/dev/shm/pwned_cpp", "/tmp/rlloop_hostile_private_tmp", "/tmp/daemon_alive", "/tmp/big"})
    EXPECT_FALSE(fs::exists(p)) << p;
  EXPECT_TRUE(fs::is_empty(scratch)) << "scratch boxes were not removed";

  fs::remove_all(host_dir);
  fs::remove_all(scratch);
}
