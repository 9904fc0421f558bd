// Program: a Python script or a C++ source compiled once inside the sandbox, then run per test.
#include <rlloop/sandbox.hpp>

namespace rlloop::sandbox {

Limits Program::compile_defaults() {
  Limits l;
  l.cpu_seconds = 20;
  l.wall_seconds = 30;
  l.memory_bytes = 2ull << 30;  // cc1plus on a template-heavy file
  l.file_size_bytes = 64ull << 20;
  l.tmp_bytes = 256ull << 20;
  l.output_bytes = 64 << 10;  // the diagnostics we keep
  l.allow_fork = true;        // g++ runs cc1plus, as and ld
  return l;
}

Program::Program(const Sandbox& sb, Language lang, std::string source, const Limits& compile_limits)
    : sb_(&sb), lang_(lang) {
  const bool py = lang == Language::python;
  box_ = std::make_shared<Box>(sb.options(), std::vector<File>{{py ? "main.py" : "main.cpp", std::move(source)}});
  if (py) {
    compiled_ = true;
    return;
  }
  RunRequest req;
  req.argv = {"/usr/bin/g++", "-std=c++17", "-O1", "-pipe", "-o", "/box/main", "/box/main.cpp"};
  req.limits = compile_limits;
  req.box_writable = true;
  RunResult r = sb.run(*box_, req);
  compiled_ = r.ok();
  compile_log_ = r.stderr_data;
  if (!compiled_ && r.outcome != Outcome::exited)
    compile_log_ += "\n[compiler " + std::string(to_string(r.outcome)) + "]";
}

RunResult Program::run(std::string_view stdin_data, const Limits& limits) const {
  if (!compiled_) {
    RunResult r;
    r.outcome = Outcome::exited;
    r.exit_code = 1;
    r.stderr_data = compile_log_;
    return r;
  }
  RunRequest req;
  req.argv = lang_ == Language::python ? std::vector<std::string>{"/usr/bin/python3", "-S", "/box/main.py"}
                                       : std::vector<std::string>{"/box/main"};
  req.stdin_data = std::string(stdin_data);
  req.limits = limits;
  return sb_->run(*box_, req);
}

}  // namespace rlloop::sandbox
