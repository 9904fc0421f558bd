// Reads the AWS SigV4 test suite (sigv4/v4 under the external data folder, never copied into the repository).
#pragma once
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "external_data.hpp"
#include "sigv4/sigv4.hpp"

namespace suite {

inline std::filesystem::path root() { return rlloop::testing::data_file("sigv4/v4"); }

// The suite's tests skip (fail under CI) when it is absent.
class SuiteTest : public ::testing::Test {
 protected:
  void SetUp() override { RLLOOP_REQUIRE_DATA(root(), "the AWS SigV4 test suite, aws-sig-v4-test-suite"); }
};

inline std::string read(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Parses the suite's raw HTTP files: request line, "Name:value" headers (lines starting with whitespace continue
// the previous value), a blank line, the body.
inline rlloop::sigv4::HttpRequest parse_request(const std::string& text) {
  rlloop::sigv4::HttpRequest req;
  std::size_t pos = text.find('\n');
  const std::string line = text.substr(0, pos);
  const std::size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  req.method = line.substr(0, sp1);
  req.target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  pos = pos == std::string::npos ? text.size() : pos + 1;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string h = text.substr(pos, end - pos);
    pos = end + 1;
    if (h.empty()) {
      if (pos < text.size()) req.body = text.substr(pos);
      break;
    }
    if ((h[0] == ' ' || h[0] == '\t') && !req.headers.empty()) {
      req.headers.back().second += "\n" + h;
      continue;
    }
    const std::size_t colon = h.find(':');
    req.headers.emplace_back(h.substr(0, colon), h.substr(colon + 1));
  }
  return req;
}

struct Case {
  std::string name;
  std::filesystem::path dir;
  nlohmann::json context;
  rlloop::sigv4::Credentials creds;
  rlloop::sigv4::SigningParams params;
};

inline Case load(const std::filesystem::path& dir) {
  Case c;
  c.name = dir.filename().string();
  c.dir = dir;
  c.context = nlohmann::json::parse(read(dir / "context.json"));
  const auto& cr = c.context.at("credentials");
  c.creds = {cr.at("access_key_id"), cr.at("secret_access_key"), cr.value("token", "")};
  c.params.region = c.context.at("region");
  c.params.service = c.context.at("service");
  c.params.time = rlloop::sigv4::parse_iso8601(c.context.at("timestamp").get<std::string>());
  c.params.normalize_path = c.context.at("normalize");
  c.params.sign_body = c.context.at("sign_body");
  c.params.omit_session_token = c.context.value("omit_session_token", false);
  c.params.expires = std::chrono::seconds(c.context.at("expiration_in_seconds").get<int>());
  return c;
}

inline std::vector<Case> all() {
  std::vector<Case> out;
  for (const auto& e : std::filesystem::directory_iterator(root()))
    if (e.is_directory() && std::filesystem::exists(e.path() / "context.json")) out.push_back(load(e.path()));
  std::sort(out.begin(), out.end(), [](const Case& a, const Case& b) { return a.name < b.name; });
  return out;
}

}  // namespace suite
