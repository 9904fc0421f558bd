// The tenants file.
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "server/server.hpp"
#include "wire/read.hpp"

namespace rlloop::server {

std::vector<Tenant> parse_tenants(const std::string& text, const std::string& source) {
  using wire::json;
  using wire::read::array;
  using wire::read::at;
  using wire::read::fail;
  using wire::read::find;
  using wire::read::integer;
  using wire::read::join;
  using wire::read::need;
  using wire::read::object;
  using wire::read::only_keys;
  using wire::read::string;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw invalid_argument(source + ": not valid JSON: " + e.what());
  }
  try {
    object(j, "");
    const json& list = array(need(j, "", "tenants"), "tenants");
    std::vector<Tenant> out;
    std::vector<std::string> seen_keys;
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string p = at("tenants", i);
      const json& t = object(list[i], p);
      only_keys(t, p, {"id", "accountId", "accessKeys", "bearerKeys", "maxSessions", "maxBodyBytes"});
      Tenant tenant;
      tenant.id = string(need(t, p, "id"), join(p, "id"));
      if (tenant.id.empty()) fail(join(p, "id"), "must not be empty");
      for (const auto& other : out)
        if (other.id == tenant.id) fail(join(p, "id"), "duplicate tenant id '" + tenant.id + "'");
      if (const json* a = find(t, "accountId")) {
        tenant.account_id = string(*a, join(p, "accountId"));
        if (tenant.account_id.size() != 12 || tenant.account_id.find_first_not_of("0123456789") != std::string::npos)
          fail(join(p, "accountId"), "must be 12 digits");
      }
      auto unique_key = [&](const std::string& key, const std::string& path) {
        if (key.empty()) fail(path, "must not be empty");
        for (const auto& k : seen_keys)
          if (k == key) fail(path, "key is used by more than one tenant entry");
        seen_keys.push_back(key);
      };
      if (const json* keys = find(t, "accessKeys")) {
        const std::string kp = join(p, "accessKeys");
        array(*keys, kp);
        for (std::size_t k = 0; k < keys->size(); ++k) {
          const std::string ep = at(kp, k);
          object((*keys)[k], ep);
          std::string akid = string(need((*keys)[k], ep, "accessKeyId"), join(ep, "accessKeyId"));
          std::string secret = string(need((*keys)[k], ep, "secretAccessKey"), join(ep, "secretAccessKey"));
          unique_key(akid, join(ep, "accessKeyId"));
          if (secret.empty()) fail(join(ep, "secretAccessKey"), "must not be empty");
          tenant.access_keys.emplace_back(std::move(akid), std::move(secret));
        }
      }
      if (const json* keys = find(t, "bearerKeys")) {
        const std::string kp = join(p, "bearerKeys");
        array(*keys, kp);
        for (std::size_t k = 0; k < keys->size(); ++k) {
          tenant.bearer_keys.push_back(string((*keys)[k], at(kp, k)));
          unique_key(tenant.bearer_keys.back(), at(kp, k));
        }
      }
      if (tenant.access_keys.empty() && tenant.bearer_keys.empty())
        fail(p, "tenant has neither accessKeys nor bearerKeys");
      if (const json* v = find(t, "maxSessions"))
        tenant.max_sessions = static_cast<std::size_t>(integer(*v, join(p, "maxSessions"), 0, 1 << 20));
      if (const json* v = find(t, "maxBodyBytes"))
        tenant.max_body_bytes =
            static_cast<std::size_t>(integer(*v, join(p, "maxBodyBytes"), 1, std::int64_t(1) << 34));
      out.push_back(std::move(tenant));
    }
    if (out.empty()) fail("tenants", "needs at least one tenant");
    return out;
  } catch (const invalid_argument& e) {
    throw invalid_argument(source + ": " + e.what());
  }
}

std::vector<Tenant> load_tenants(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw io_error("cannot read tenants file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_tenants(ss.str(), path);
}

}  // namespace rlloop::server
