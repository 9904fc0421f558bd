#include "server/tinker_downloads.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>

#include <rlloop/error.hpp>

#include "server/api_impl.hpp"

namespace rlloop::server {

namespace {
namespace fs = std::filesystem;

// 128 random bits as hex: the URL's only credential.
std::string new_token() {
  std::random_device random;
  std::string token;
  for (int i = 0; i < 4; ++i) {
    char word[9];
    std::snprintf(word, sizeof word, "%08x", static_cast<unsigned>(random()));
    token += word;
  }
  return token;
}

[[noreturn]] void gone(const std::string& what) { throw api_error("NotFound", 404, what); }
}  // namespace

nlohmann::json ExternalDownloads::sign(const std::string& directory, const std::string& base_url, double now) {
  Signature signature{directory, {}, now + kValidSeconds};
  std::error_code ec;
  for (fs::recursive_directory_iterator it(directory, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file()) signature.files.insert(fs::relative(it->path(), directory).generic_string());
  if (ec) throw io_error("external weights " + directory + ": " + ec.message());
  const std::string token = new_token();
  nlohmann::json urls = nlohmann::json::object();
  for (const auto& file : signature.files) urls[file] = base_url + kRoute + token + "/" + file;
  std::lock_guard lock(mu_);
  std::erase_if(signatures_, [&](const auto& entry) { return entry.second.expires <= now; });
  signatures_.emplace(token, std::move(signature));
  return urls;
}

Response ExternalDownloads::serve(const std::string& path, double now) {
  const std::string rest = path.substr(std::string(kRoute).size());
  const auto slash = rest.find('/');
  if (slash == std::string::npos) gone("no file in " + path);
  const std::string token = rest.substr(0, slash), name = rest.substr(slash + 1);
  std::string file;
  {
    std::lock_guard lock(mu_);
    const auto it = signatures_.find(token);
    if (it == signatures_.end() || it->second.expires <= now)
      gone("this URL is not signed or has expired (get_external_weights_urls signs new ones)");
    if (!it->second.files.count(name)) gone("the signed checkpoint has no file " + name);
    file = (fs::path(it->second.directory) / name).string();
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) gone("the checkpoint's file " + name + " is no longer there");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return Response{200, "application/octet-stream", {}, std::move(bytes)};
}

}  // namespace rlloop::server
