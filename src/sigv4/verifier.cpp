// The server side: recompute the signature of a request from the secret of the access key it names.
#include <cctype>
#include <map>

#include "sigv4/sigv4.hpp"

namespace rlloop::sigv4 {

namespace {

[[noreturn]] void reject(const std::string& code, const std::string& message) { throw auth_error(code, 403, message); }

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t end = s.find(sep, start);
    out.emplace_back(s.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}

// What a request claims: from the Authorization header or from the presigned query parameters.
struct Claim {
  std::string credential;  // AKID/date/region/service/aws4_request
  std::string signed_headers;
  std::string signature;
  std::string amz_date;
  std::optional<std::int64_t> expires;  // presigned only
  bool presigned = false;
};

Claim claim_from_header(const HttpRequest& req, const std::string& auth) {
  Claim c;
  constexpr std::string_view algo = "AWS4-HMAC-SHA256 ";
  if (auth.rfind(algo, 0) != 0)
    reject("IncompleteSignature",
           "Authorization header must use AWS4-HMAC-SHA256 (got '" + auth.substr(0, auth.find(' ')) + "')");
  for (const std::string& part : split(std::string_view(auth).substr(algo.size()), ',')) {
    const std::string_view p = trim(part);
    const std::size_t eq = p.find('=');
    if (eq == std::string_view::npos)
      reject("IncompleteSignature", "malformed Authorization component '" + std::string(p) + "'");
    const std::string_view key = p.substr(0, eq), value = p.substr(eq + 1);
    if (key == "Credential")
      c.credential = value;
    else if (key == "SignedHeaders")
      c.signed_headers = value;
    else if (key == "Signature")
      c.signature = value;
  }
  if (c.credential.empty()) reject("IncompleteSignature", "Authorization header lacks Credential");
  if (c.signed_headers.empty()) reject("IncompleteSignature", "Authorization header lacks SignedHeaders");
  if (c.signature.empty()) reject("IncompleteSignature", "Authorization header lacks Signature");
  const auto date = req.header("X-Amz-Date");
  if (!date) reject("IncompleteSignature", "request lacks the X-Amz-Date header");
  c.amz_date = *date;
  return c;
}

Claim claim_from_query(std::string_view query) {
  std::map<std::string, std::string> params;
  for (const std::string& part : split(query, '&')) {
    const std::size_t eq = part.find('=');
    if (eq != std::string::npos) params[uri_decode(part.substr(0, eq))] = uri_decode(part.substr(eq + 1));
  }
  Claim c;
  c.presigned = true;
  auto need = [&](const char* key) -> std::string {
    auto it = params.find(key);
    if (it == params.end() || it->second.empty())
      reject("IncompleteSignature", std::string("presigned request lacks ") + key);
    return it->second;
  };
  if (need("X-Amz-Algorithm") != "AWS4-HMAC-SHA256")
    reject("IncompleteSignature", "X-Amz-Algorithm must be AWS4-HMAC-SHA256");
  c.credential = need("X-Amz-Credential");
  c.signed_headers = need("X-Amz-SignedHeaders");
  c.signature = need("X-Amz-Signature");
  c.amz_date = need("X-Amz-Date");
  const std::string expires = need("X-Amz-Expires");
  try {
    std::size_t used = 0;
    c.expires = std::stoll(expires, &used);
    if (used != expires.size() || *c.expires < 1 || *c.expires > 604800) throw std::out_of_range("");
  } catch (const std::exception&) {
    reject("IncompleteSignature", "X-Amz-Expires must be an integer in [1, 604800]");
  }
  return c;
}

}  // namespace

Identity verify(const HttpRequest& req, const SecretLookup& lookup, clock::time_point now,
                const VerifyOptions& options) {
  const std::size_t q = req.target.find('?');
  const std::string_view query =
      q == std::string::npos ? std::string_view{} : std::string_view(req.target).substr(q + 1);
  Claim claim;
  if (const auto auth = req.header("Authorization"))
    claim = claim_from_header(req, *auth);
  else if (query.find("X-Amz-Signature=") != std::string_view::npos ||
           query.find("X-Amz-Algorithm=") != std::string_view::npos)
    claim = claim_from_query(query);
  else
    reject("MissingAuthenticationToken", "request is not signed (no Authorization header or X-Amz-Signature)");

  const auto scope = split(claim.credential, '/');
  if (scope.size() != 5 || scope[4] != "aws4_request" || scope[0].empty())
    reject("IncompleteSignature", "Credential must be <access key id>/<date>/<region>/<service>/aws4_request");
  Identity id{scope[0], scope[2], scope[3]};
  if (options.service && id.service != *options.service)
    reject("SignatureDoesNotMatch",
           "credential scope names service '" + id.service + "', expected '" + *options.service + "'");

  clock::time_point signed_at;
  try {
    signed_at = parse_amz_date(claim.amz_date);
  } catch (const invalid_argument&) {
    reject("IncompleteSignature", "X-Amz-Date '" + claim.amz_date + "' is not yyyymmddThhmmssZ");
  }
  if (scope[1] != claim.amz_date.substr(0, 8))
    reject("SignatureDoesNotMatch",
           "credential scope date " + scope[1] + " does not match X-Amz-Date " + claim.amz_date);
  if (claim.presigned) {
    if (now < signed_at - options.max_skew)
      reject("InvalidSignatureException", "presigned request is dated in the future");
    if (now > signed_at + std::chrono::seconds(*claim.expires))
      reject("InvalidSignatureException", "Signature expired: presigned request expired at " +
                                              format_amz_date(signed_at + std::chrono::seconds(*claim.expires)));
  } else if (now - signed_at > options.max_skew || signed_at - now > options.max_skew) {
    reject("InvalidSignatureException", "Signature expired: " + claim.amz_date + " is not within " +
                                            std::to_string(options.max_skew.count()) + " s of the server time " +
                                            format_amz_date(now));
  }

  const std::vector<std::string> names = split(claim.signed_headers, ';');
  bool has_host = false;
  for (const auto& n : names) has_host = has_host || n == "host";
  if (!has_host) reject("SignatureDoesNotMatch", "SignedHeaders must include host");

  const auto secret = lookup(id.access_key_id);
  if (!secret)
    reject("UnrecognizedClientException",
           "The security token included in the request is invalid (unknown access key id)");

  // The body is always hashed here, so a request cannot claim a different payload than the one it carries.
  const std::string payload_hash = hex(sha256(req.body));
  if (const auto declared = req.header("x-amz-content-sha256"); declared && *declared != payload_hash)
    reject("SignatureDoesNotMatch", "x-amz-content-sha256 does not match the request body");

  std::string creq;
  try {
    std::vector<std::string> skip;
    if (claim.presigned) skip.push_back("X-Amz-Signature");
    if (claim.presigned && options.unsigned_query_session_token) skip.push_back("X-Amz-Security-Token");
    creq = canonical_request(req, names, options.normalize_path, payload_hash, skip);
  } catch (const invalid_argument& e) {
    reject("SignatureDoesNotMatch", e.what());
  }
  const std::string expected =
      signature(signing_key(*secret, scope[1], id.region, id.service),
                string_to_sign(claim.amz_date, claim.credential.substr(id.access_key_id.size() + 1), creq));
  if (!constant_time_equal(expected, claim.signature))
    reject("SignatureDoesNotMatch",
           "The request signature we calculated does not match the signature you provided. Check your AWS Secret "
           "Access Key "
           "and signing method.");
  return id;
}

}  // namespace rlloop::sigv4
