// The sandbox runner itself: I/O, exit codes, limits, isolation basics, option validation.
#include <gtest/gtest.h>

#include <cstdlib>

#include <rlloop/error.hpp>
#include <rlloop/sandbox.hpp>

using namespace rlloop;
using namespace rlloop::sandbox;

namespace {
const Sandbox& sb() {
  static Sandbox s;
  return s;
}
// A second of CPU; the wall-clock limit is generous because the first Python start after a fresh build, beside
// other tests on a loaded 2-core machine, has taken more than 3 s (a timeout would then fail a test about I/O).
Limits quick() {
  Limits l;
  l.cpu_seconds = 1;
  l.wall_seconds = 15;
  return l;
}
RunResult py(const std::string& src, const std::string& in = "", Limits l = quick()) {
  return Program(sb(), Language::python, src).run(in, l);
}
}  // namespace

TEST(Sandbox, RunsPythonWithStdinAndStdout) {
  const auto r = py("import sys\nxs = sys.stdin.read().split()\nprint(sum(map(int, xs)))\n", "1 2 3 4\n");
  ASSERT_EQ(r.outcome, Outcome::exited) << r.stderr_data;
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.stdout_data, "10\n");
}

TEST(Sandbox, LargeStdinAndStdoutPassThrough) {
  std::string big(3 << 20, 'a');  // larger than any pipe buffer, both ways
  Limits l = quick();
  l.output_bytes = 4 << 20;
  const auto r = py("import sys\nsys.stdout.write(sys.stdin.read())\n", big, l);
  ASSERT_TRUE(r.ok()) << to_string(r.outcome) << r.stderr_data;
  EXPECT_EQ(r.stdout_data.size(), big.size());
  EXPECT_EQ(r.stdout_data, big);
}

TEST(Sandbox, ReportsExitCodesAndSignals) {
  const auto e = py("import sys\nsys.stderr.write('bad')\nsys.exit(3)\n");
  EXPECT_EQ(e.outcome, Outcome::exited);
  EXPECT_EQ(e.exit_code, 3);
  EXPECT_EQ(e.stderr_data, "bad");
  const auto s = py("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n");
  EXPECT_EQ(s.outcome, Outcome::signaled);
  EXPECT_EQ(s.signal, 11);
}

TEST(Sandbox, EnforcesCpuWallAndOutputLimits) {
  const auto cpu = py("while True: pass\n");
  EXPECT_EQ(cpu.outcome, Outcome::cpu_limit);
  Limits short_wall = quick();
  short_wall.wall_seconds = 2;
  const auto wall = py("import time\ntime.sleep(60)\n", "", short_wall);
  EXPECT_EQ(wall.outcome, Outcome::timeout);
  Limits l = quick();
  l.output_bytes = 1000;
  const auto out = py("print('x' * 5000)\n", "", l);
  EXPECT_EQ(out.outcome, Outcome::output_limit);
  EXPECT_EQ(out.stdout_data.size(), 1000u);
}

TEST(Sandbox, SeesNoEnvironmentNetworkOrHostFiles) {
  ::setenv("RLLOOP_SANDBOX_TEST_SECRET", "hunter2", 1);
  const auto r =
      py("import os, socket\n"
         "print(sorted(os.environ))\n"
         "print(os.path.exists('/root'), os.path.exists('/home'), os.path.exists('/etc/shadow'))\n"
         "try:\n  socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n  print('socket')\nexcept OSError:\n  "
         "print('nosocket')\n");
  ASSERT_TRUE(r.ok()) << r.stderr_data;
  EXPECT_EQ(r.stdout_data.find("RLLOOP_SANDBOX_TEST_SECRET"), std::string::npos) << r.stdout_data;
  EXPECT_NE(r.stdout_data.find("False False False"), std::string::npos) << r.stdout_data;
  EXPECT_NE(r.stdout_data.find("nosocket"), std::string::npos) << r.stdout_data;
}

TEST(Sandbox, BoxIsReadOnlyAndTmpIsWritable) {
  const auto r =
      py("open('/tmp/a', 'w').write('ok')\nprint(open('/tmp/a').read())\n"
         "try:\n  open('/box/x', 'w')\n  print('box writable')\nexcept OSError:\n  print('box read-only')\n");
  ASSERT_TRUE(r.ok()) << r.stderr_data;
  EXPECT_EQ(r.stdout_data, "ok\nbox read-only\n");
}

TEST(Sandbox, CompilesAndRunsCpp) {
  const Program ok(sb(), Language::cpp,
                   "#include <iostream>\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a*b;}\n");
  ASSERT_TRUE(ok.compiled()) << ok.compile_log();
  EXPECT_EQ(ok.run("6 7", quick()).stdout_data, "42");
  const Program bad(sb(), Language::cpp, "int main() { return undefined_thing; }\n");
  EXPECT_FALSE(bad.compiled());
  EXPECT_NE(bad.compile_log().find("undefined_thing"), std::string::npos) << bad.compile_log();
  const auto r = bad.run("", quick());
  EXPECT_EQ(r.exit_code, 1);
}

TEST(Sandbox, RunWithFilesMountsThemInBox) {
  RunRequest req;
  req.argv = {"/usr/bin/python3", "-S", "/box/prog.py", "/box/data.txt"};
  req.limits = quick();
  const auto r =
      sb().run({{"prog.py", "import sys\nprint(open(sys.argv[1]).read().upper())\n"}, {"data.txt", "hi"}}, req);
  ASSERT_TRUE(r.ok()) << r.stderr_data;
  EXPECT_EQ(r.stdout_data, "HI\n");
}

TEST(Sandbox, ValidationNamesTheField) {
  Limits l;
  l.cpu_seconds = 0;
  try {
    l.validate();
    FAIL() << "expected invalid_argument";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("Limits::cpu_seconds"), std::string::npos);
  }
  EXPECT_THROW(Sandbox(Options{.bwrap_path = "relative/bwrap"}), invalid_argument);
  EXPECT_THROW(Sandbox(Options{.bwrap_path = "/nonexistent/bwrap"}), unsupported);
  RunRequest req;
  req.argv = {"python3"};
  EXPECT_THROW(sb().run({}, req), invalid_argument);
  EXPECT_THROW(Box(sb().options(), {{"../escape", "x"}}), invalid_argument);
  EXPECT_EQ(parse_language("c++"), Language::cpp);
  EXPECT_THROW(parse_language("rust"), invalid_argument);
}
