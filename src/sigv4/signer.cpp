// The client side: sign with an Authorization header, or presign into the query string.
#include <algorithm>
#include <cctype>

#include "sigv4/sigv4.hpp"

namespace rlloop::sigv4 {

namespace {
std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}
// Headers that proxies add, drop or rewrite; signing them would break valid requests in transit.
bool unsignable(const std::string& name) {
  return name == "authorization" || name == "user-agent" || name == "connection" || name == "expect" ||
         name == "x-amzn-trace-id" || name == "transfer-encoding" || name == "keep-alive";
}
std::vector<std::string> signable_names(const HttpRequest& req) {
  std::vector<std::string> names;
  for (const auto& [k, v] : req.headers) {
    std::string n = lower(k);
    if (!unsignable(n) && std::find(names.begin(), names.end(), n) == names.end()) names.push_back(std::move(n));
  }
  return names;
}
}  // namespace

void sign(HttpRequest& req, const Credentials& creds, const SigningParams& params) {
  const std::string amz_date = format_amz_date(params.time);
  const std::string date8 = amz_date.substr(0, 8);
  const std::string payload_hash = hex(sha256(req.body));
  req.set_header("X-Amz-Date", amz_date);
  if (params.sign_body) req.set_header("x-amz-content-sha256", payload_hash);
  if (!creds.session_token.empty() && !params.omit_session_token)
    req.set_header("X-Amz-Security-Token", creds.session_token);

  const auto names = signable_names(req);
  const std::string creq = canonical_request(req, names, params.normalize_path, payload_hash);
  const std::string scope = credential_scope(date8, params.region, params.service);
  const std::string sig = signature(signing_key(creds.secret_access_key, date8, params.region, params.service),
                                    string_to_sign(amz_date, scope, creq));
  const CanonicalHeaders h = canonical_headers(req, names);
  req.set_header("Authorization", "AWS4-HMAC-SHA256 Credential=" + creds.access_key_id + "/" + scope +
                                      ", SignedHeaders=" + h.signed_headers + ", Signature=" + sig);
  if (!creds.session_token.empty() && params.omit_session_token)
    req.set_header("X-Amz-Security-Token", creds.session_token);
}

void presign(HttpRequest& req, const Credentials& creds, const SigningParams& params) {
  const std::string amz_date = format_amz_date(params.time);
  const std::string date8 = amz_date.substr(0, 8);
  const std::string scope = credential_scope(date8, params.region, params.service);
  const auto names = signable_names(req);
  const CanonicalHeaders h = canonical_headers(req, names);

  std::string query =
      "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=" + uri_encode(creds.access_key_id + "/" + scope, false) +
      "&X-Amz-Date=" + amz_date + "&X-Amz-SignedHeaders=" + uri_encode(h.signed_headers, false) +
      "&X-Amz-Expires=" + std::to_string(params.expires.count());
  const std::string token =
      creds.session_token.empty() ? "" : "&X-Amz-Security-Token=" + uri_encode(creds.session_token, false);
  if (!params.omit_session_token) query += token;
  req.target += (req.target.find('?') == std::string::npos ? "?" : "&") + query;

  const std::string creq = canonical_request(req, names, params.normalize_path, hex(sha256(req.body)));
  const std::string sig = signature(signing_key(creds.secret_access_key, date8, params.region, params.service),
                                    string_to_sign(amz_date, scope, creq));
  if (params.omit_session_token) req.target += token;
  req.target += "&X-Amz-Signature=" + sig;
}

}  // namespace rlloop::sigv4
