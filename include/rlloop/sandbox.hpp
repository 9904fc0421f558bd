// Runs untrusted programs (model-written Python or C++) under bubblewrap with resource limits.
//
// Every run gets: no network (own net namespace), its own pid namespace (everything it starts dies with it),
// a read-only /usr, no /home, /root or /etc secrets, a private size-capped /tmp as its only writable place,
// a cleared environment, a seccomp filter (no new processes, no non-Unix sockets, no ptrace/mount/...),
// (programs under test may not create processes or threads), setrlimit caps (CPU seconds, address space, processes,
// file size) and a wall-clock deadline after which the whole process group is killed. Output comes back through pipes,
// each capped.
//
// What the program did is data (RunResult::outcome); only a failure to start the sandbox at all — a
// missing bwrap, a broken option — throws rlloop::error. Link rlloop::sandbox.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace rlloop::sandbox {

// Per-run resource caps. Defaults suit a unit-test run of a short program.
struct Limits {
  double cpu_seconds = 2.0;                     // RLIMIT_CPU (SIGXCPU, then SIGKILL one second later)
  double wall_seconds = 5.0;                    // deadline; the process group is killed when it passes
  std::uint64_t memory_bytes = 512ull << 20;    // RLIMIT_AS: address space of each process
  std::uint64_t file_size_bytes = 16ull << 20;  // RLIMIT_FSIZE: largest file a process may write
  std::uint64_t tmp_bytes = 64ull << 20;        // size of the private /tmp tmpfs
  std::uint64_t output_bytes = 1ull << 20;      // cap on captured stdout and on stderr; more = killed
  int max_processes = 256;                      // RLIMIT_NPROC of the unprivileged sandbox user
  bool allow_fork = false;                      // compilers need it; programs under test do not

  // Throws rlloop::invalid_argument naming the first bad field.
  void validate() const;
};

struct Options {
  std::string bwrap_path = "/usr/bin/bwrap";
  // When rlloop runs as root, the sandbox drops to this uid/gid first (root is exempt from RLIMIT_NPROC and
  // owns every file it could read). Unused when not root.
  std::uint32_t sandbox_uid = 65534;
  std::uint32_t sandbox_gid = 65534;
  // Host folder for per-run scratch directories (the program's files, the compiled binary).
  std::string scratch_root = "/tmp";

  void validate() const;
};

// A file placed in the run's /box folder before the program starts.
struct File {
  std::string name;  // plain file name, no '/'
  std::string content;
  bool executable = false;
};

struct RunRequest {
  std::vector<std::string> argv;  // argv[0] is an absolute path inside the sandbox (e.g. /usr/bin/python3)
  std::string stdin_data;
  Limits limits;
  bool box_writable = false;  // /box is read-only unless the run must write there (a compiler's output)
};

enum class Outcome {
  exited,         // ended by itself; see exit_code
  signaled,       // killed by a signal (crash, abort, SIGXFSZ, ...); see signal
  cpu_limit,      // exceeded its CPU-time limit
  timeout,        // still running at the wall-clock deadline
  output_limit,   // wrote more than Limits::output_bytes to stdout or stderr
  sandbox_error,  // bwrap itself failed to set up the sandbox
};
std::string_view to_string(Outcome o) noexcept;

struct RunResult {
  Outcome outcome = Outcome::sandbox_error;
  int exit_code = -1;  // valid for Outcome::exited
  int signal = 0;      // valid for Outcome::signaled
  std::string stdout_data;
  std::string stderr_data;
  double wall_seconds = 0;

  bool ok() const noexcept { return outcome == Outcome::exited && exit_code == 0; }
};

// A scratch folder on the host, mounted as /box inside the sandbox; removed on destruction.
class Box {
 public:
  Box(const Options& opts, const std::vector<File>& files);
  ~Box();
  Box(const Box&) = delete;
  Box& operator=(const Box&) = delete;
  const std::string& host_path() const noexcept { return path_; }

 private:
  std::string path_;
};

// Thread-safe: one Sandbox may serve many concurrent runs.
class Sandbox {
 public:
  explicit Sandbox(Options opts = {});
  ~Sandbox();
  Sandbox(Sandbox&&) noexcept;
  Sandbox& operator=(Sandbox&&) noexcept;

  // Runs req.argv inside the sandbox with `box` mounted at /box.
  RunResult run(const Box& box, const RunRequest& req) const;

  // Convenience: a fresh box holding `files`, one run, box removed.
  RunResult run(const std::vector<File>& files, const RunRequest& req) const;

  const Options& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- languages -----------------------------------------------------------------------------------------------

enum class Language { python, cpp };
std::string_view to_string(Language l) noexcept;
// "python", "py", "python3" / "cpp", "c++", "cxx"; throws rlloop::invalid_argument otherwise.
Language parse_language(std::string_view name);

// A program ready to run any number of times (for C++: compiled once in its own box).
class Program {
 public:
  // Compiles when needed (C++: g++ -O1 inside the sandbox with compile_limits). Never throws for a bad
  // program: check compiled() and compile_log().
  Program(const Sandbox& sb, Language lang, std::string source, const Limits& compile_limits = compile_defaults());
  bool compiled() const noexcept { return compiled_; }
  const std::string& compile_log() const noexcept { return compile_log_; }
  Language language() const noexcept { return lang_; }

  // One execution with `stdin_data`; compile failures come back as Outcome::exited with exit_code 1.
  RunResult run(std::string_view stdin_data, const Limits& limits) const;

  static Limits compile_defaults();

 private:
  const Sandbox* sb_;
  Language lang_;
  std::shared_ptr<Box> box_;
  bool compiled_ = false;
  std::string compile_log_;
};

}  // namespace rlloop::sandbox
