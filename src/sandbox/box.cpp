// Box: the host scratch folder mounted at /box inside the sandbox.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/sandbox.hpp>

namespace rlloop::sandbox {
namespace {
void write_file(const std::string& path, const std::string& content, mode_t mode) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) throw io_error("sandbox: cannot create " + path + ": " + std::strerror(errno));
  std::size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int e = errno;
      ::close(fd);
      throw io_error("sandbox: cannot write " + path + ": " + std::strerror(e));
    }
    done += static_cast<std::size_t>(n);
  }
  ::fchmod(fd, mode);  // umask may have narrowed it; the sandbox user must be able to read it
  ::close(fd);
}
}  // namespace

Box::Box(const Options& opts, const std::vector<File>& files) {
  std::string tmpl = opts.scratch_root + "/rlloop-box-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) throw io_error("sandbox: mkdtemp in " + opts.scratch_root + ": " + std::strerror(errno));
  path_ = buf.data();
  try {
    for (const auto& f : files) {
      if (f.name.empty() || f.name.find('/') != std::string::npos || f.name == "." || f.name == "..")
        throw invalid_argument("sandbox: File::name '" + f.name + "' must be a plain file name");
      write_file(path_ + "/" + f.name, f.content, f.executable ? 0755 : 0644);
    }
    // As root we hand the folder to the unprivileged sandbox user, so a compiler run there can write into it.
    if (::geteuid() == 0 && ::chown(path_.c_str(), opts.sandbox_uid, opts.sandbox_gid) != 0)
      throw io_error("sandbox: chown " + path_ + ": " + std::strerror(errno));
    ::chmod(path_.c_str(), 0755);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    throw;
  }
}

Box::~Box() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace rlloop::sandbox
