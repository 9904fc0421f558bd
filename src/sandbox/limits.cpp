// Validation of the sandbox's option structs and names of its enums.
#include <rlloop/error.hpp>
#include <rlloop/sandbox.hpp>

namespace rlloop::sandbox {
namespace {
void require(bool ok, const char* field, const char* why) {
  if (!ok) throw invalid_argument(std::string("sandbox: ") + field + " " + why);
}
}  // namespace

void Limits::validate() const {
  require(cpu_seconds > 0, "Limits::cpu_seconds", "must be > 0");
  require(wall_seconds > 0, "Limits::wall_seconds", "must be > 0");
  require(memory_bytes >= (16ull << 20), "Limits::memory_bytes", "must be at least 16 MiB (bwrap needs it)");
  require(file_size_bytes > 0, "Limits::file_size_bytes", "must be > 0");
  require(tmp_bytes >= 4096, "Limits::tmp_bytes", "must be at least 4096");
  require(output_bytes > 0, "Limits::output_bytes", "must be > 0");
  require(max_processes >= 4, "Limits::max_processes", "must be at least 4 (bwrap itself needs 2)");
}

void Options::validate() const {
  require(!bwrap_path.empty() && bwrap_path.front() == '/', "Options::bwrap_path", "must be an absolute path");
  require(sandbox_uid != 0, "Options::sandbox_uid", "must not be root (0)");
  require(sandbox_gid != 0, "Options::sandbox_gid", "must not be root (0)");
  require(!scratch_root.empty() && scratch_root.front() == '/', "Options::scratch_root", "must be an absolute path");
}

std::string_view to_string(Outcome o) noexcept {
  switch (o) {
    case Outcome::exited:
      return "exited";
    case Outcome::signaled:
      return "signaled";
    case Outcome::cpu_limit:
      return "cpu_limit";
    case Outcome::timeout:
      return "timeout";
    case Outcome::output_limit:
      return "output_limit";
    case Outcome::sandbox_error:
      return "sandbox_error";
  }
  return "unknown";
}

std::string_view to_string(Language l) noexcept { return l == Language::python ? "python" : "cpp"; }

Language parse_language(std::string_view name) {
  if (name == "python" || name == "py" || name == "python3") return Language::python;
  if (name == "cpp" || name == "c++" || name == "cxx") return Language::cpp;
  throw invalid_argument("sandbox: unknown language '" + std::string(name) + "' (expected python or cpp)");
}

}  // namespace rlloop::sandbox
