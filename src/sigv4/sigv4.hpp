// AWS Signature Version 4 (AWS4-HMAC-SHA256): the pieces of the algorithm, a signer (clients) and a verifier
// (rlloop-server). Both follow the AWS test suite in ../shared/data/sigv4/v4, header and query (presigned) forms.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <rlloop/error.hpp>

namespace rlloop::sigv4 {

using clock = std::chrono::system_clock;

// An HTTP request as signed: `target` is the request-line target (path and optional "?query") exactly as sent.
struct HttpRequest {
  std::string method;
  std::string target;
  std::vector<std::pair<std::string, std::string>> headers;  // in arrival order; duplicates allowed
  std::string body;

  // First value of a header (case-insensitive name), or nullopt.
  std::optional<std::string> header(std::string_view name) const;
  void set_header(std::string name, std::string value);  // replaces every header of that name
};

struct Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty when the credentials are not temporary
};

struct SigningParams {
  std::string region = "us-east-1";
  std::string service = "sagemaker";
  clock::time_point time = clock::now();
  // Remove dot segments and duplicate slashes from the path before signing; S3-style services sign it as is.
  bool normalize_path = true;
  // Add x-amz-content-sha256 (the payload hash) as a signed header.
  bool sign_body = false;
  // Attach the session token after signing (services that do not include it in the signature).
  bool omit_session_token = false;
  std::chrono::seconds expires{3600};  // presigned URLs only
};

// An authentication failure with the AWS error name (SignatureDoesNotMatch, IncompleteSignature, ...) and the
// HTTP status to answer with.
class auth_error : public coded_error {
 public:
  using coded_error::coded_error;
};

// ---- crypto (OpenSSL) ----
std::string sha256(std::string_view data);                             // raw 32 bytes
std::string hmac_sha256(std::string_view key, std::string_view data);  // raw 32 bytes
std::string hex(std::string_view bytes);                               // lowercase
bool constant_time_equal(std::string_view a, std::string_view b);

// ---- the algorithm ----
std::string format_amz_date(clock::time_point t);      // 20150830T123600Z
clock::time_point parse_amz_date(std::string_view s);  // throws invalid_argument
clock::time_point parse_iso8601(std::string_view s);   // 2015-08-30T12:36:00Z; throws invalid_argument
std::string uri_encode(std::string_view s, bool keep_slash);
std::string uri_decode(std::string_view s);
std::string canonical_path(std::string_view path, bool normalize);
// Sorted, strictly re-encoded query; `skip` drops parameters (X-Amz-Signature when verifying a presigned URL).
std::string canonical_query(std::string_view query, const std::vector<std::string>& skip = {});
std::string canonical_header_value(std::string_view value);  // trimmed, inner whitespace runs collapsed

struct CanonicalHeaders {
  std::string block;           // "name:value\n" lines
  std::string signed_headers;  // "host;x-amz-date"
};
// Canonical form of the headers named in `names` (lowercase); every name must be present.
CanonicalHeaders canonical_headers(const HttpRequest& req, const std::vector<std::string>& names);

std::string canonical_request(const HttpRequest& req, const std::vector<std::string>& signed_names, bool normalize_path,
                              std::string_view payload_hash_hex, const std::vector<std::string>& query_skip = {});
std::string credential_scope(std::string_view date8, std::string_view region, std::string_view service);
std::string string_to_sign(std::string_view amz_date, std::string_view scope, std::string_view canonical_request);
std::string signing_key(std::string_view secret, std::string_view date8, std::string_view region,
                        std::string_view service);
std::string signature(std::string_view signing_key, std::string_view string_to_sign);  // hex

// ---- signer ----
// Signs in place with the Authorization header: adds X-Amz-Date, X-Amz-Security-Token (if any) and, with
// sign_body, x-amz-content-sha256. Every header present (except hop-by-hop ones) is signed.
void sign(HttpRequest& req, const Credentials& creds, const SigningParams& params);
// Presigns in place: appends the X-Amz-* query parameters and X-Amz-Signature to the target.
void presign(HttpRequest& req, const Credentials& creds, const SigningParams& params);

// ---- verifier ----
struct VerifyOptions {
  std::chrono::seconds max_skew{15 * 60};  // header-signed requests: |now - X-Amz-Date| must not exceed this
  bool normalize_path = true;
  std::optional<std::string> service;  // required signing name; nullopt accepts any
  // Presigned URLs whose X-Amz-Security-Token was appended after signing (the suite's omit_session_token).
  bool unsigned_query_session_token = false;
};
struct Identity {
  std::string access_key_id;
  std::string region;
  std::string service;
};
// Secret for an access key id, or nullopt when the key is unknown.
using SecretLookup = std::function<std::optional<std::string>(const std::string& access_key_id)>;

// Checks a signed (Authorization header) or presigned (query) request and returns who signed it; throws
// auth_error with MissingAuthenticationToken, IncompleteSignature, UnrecognizedClientException,
// InvalidSignatureException (expired / skewed) or SignatureDoesNotMatch.
Identity verify(const HttpRequest& req, const SecretLookup& lookup, clock::time_point now,
                const VerifyOptions& options = {});

}  // namespace rlloop::sigv4
