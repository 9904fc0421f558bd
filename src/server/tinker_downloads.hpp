// The files of Tinker's external weights checkpoints (save_weights_external: a PEFT adapter directory), handed out
// as Tinker hands them out: get_external_weights_urls signs each file's URL, and a GET of that URL, which carries
// its own credential (a random token) instead of an API key, answers the file's bytes until the URL expires.
// Signatures live in memory: a restarted server answers 404 to the URLs it signed before, and the client asks for
// new ones.
#pragma once
#include <map>
#include <mutex>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "server/server.hpp"

namespace rlloop::server {

class ExternalDownloads {
 public:
  static constexpr double kValidSeconds = 3600;
  static constexpr const char* kRoute = "/api/v1/external_weights_files/";

  // {file relative to `directory`: URL}: every regular file under `directory`, each as `base_url` + kRoute + token +
  // "/" + file, served until `now` + kValidSeconds. Throws io_error when the directory cannot be read.
  nlohmann::json sign(const std::string& directory, const std::string& base_url, double now);

  // Whether `path` is a signed URL's path (answered without an API key).
  static bool is_download(const std::string& path) { return path.rfind(kRoute, 0) == 0; }
  // The file a signed URL names, or api_error 404: an unknown or expired token, a file the signature does not list.
  Response serve(const std::string& path, double now);

 private:
  struct Signature {
    std::string directory;
    std::set<std::string> files;  // relative paths: the only ones served
    double expires = 0;
  };
  std::mutex mu_;
  std::map<std::string, Signature> signatures_;  // by token
};

}  // namespace rlloop::server
