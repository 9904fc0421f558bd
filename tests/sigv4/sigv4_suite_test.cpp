// Every case of the AWS SigV4 suite: the canonical request, string to sign and signature the signer computes, in
// the header and the query (presigned) form, and the verifier accepting the suite's own signed requests.
#include <gtest/gtest.h>

#include "suite.hpp"

using namespace rlloop::sigv4;

namespace {

using SigV4Suite = suite::SuiteTest;

std::string trim_end(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// The canonical request the signer built: recomputed from the signed request with its signed-header list.
std::string header_canonical(const HttpRequest& signed_req, const suite::Case& c) {
  const std::string auth = *signed_req.header("Authorization");
  const std::size_t a = auth.find("SignedHeaders=") + 14;
  const std::string list = auth.substr(a, auth.find(',', a) - a);
  std::vector<std::string> names;
  for (std::size_t s = 0, e; s <= list.size(); s = e + 1) {
    e = list.find(';', s);
    if (e == std::string::npos) e = list.size();
    names.push_back(list.substr(s, e - s));
  }
  return canonical_request(signed_req, names, c.params.normalize_path, hex(sha256(signed_req.body)));
}

SecretLookup suite_keys(const suite::Case& c) {
  return [c](const std::string& akid) -> std::optional<std::string> {
    if (akid == c.creds.access_key_id) return c.creds.secret_access_key;
    return std::nullopt;
  };
}

}  // namespace

TEST_F(SigV4Suite, HasAllCases) { EXPECT_GE(suite::all().size(), 38u); }

TEST_F(SigV4Suite, HeaderSigningMatchesEveryCase) {
  for (const auto& c : suite::all()) {
    SCOPED_TRACE(c.name);
    HttpRequest req = suite::parse_request(suite::read(c.dir / "request.txt"));
    sign(req, c.creds, c.params);
    const std::string creq = header_canonical(req, c);
    EXPECT_EQ(creq, trim_end(suite::read(c.dir / "header-canonical-request.txt")));
    const std::string amz_date = format_amz_date(c.params.time);
    const std::string sts =
        string_to_sign(amz_date, credential_scope(amz_date.substr(0, 8), c.params.region, c.params.service), creq);
    EXPECT_EQ(sts, trim_end(suite::read(c.dir / "header-string-to-sign.txt")));
    const std::string sig = trim_end(suite::read(c.dir / "header-signature.txt"));
    const HttpRequest expected = suite::parse_request(suite::read(c.dir / "header-signed-request.txt"));
    EXPECT_EQ(req.header("Authorization"), expected.header("Authorization"));
    EXPECT_NE(req.header("Authorization")->find("Signature=" + sig), std::string::npos);
    EXPECT_EQ(req.header("X-Amz-Security-Token"), expected.header("X-Amz-Security-Token"));
  }
}

TEST_F(SigV4Suite, QuerySigningMatchesEveryCase) {
  for (const auto& c : suite::all()) {
    SCOPED_TRACE(c.name);
    HttpRequest req = suite::parse_request(suite::read(c.dir / "request.txt"));
    presign(req, c.creds, c.params);
    const std::string sig = trim_end(suite::read(c.dir / "query-signature.txt"));
    EXPECT_NE(req.target.find("X-Amz-Signature=" + sig), std::string::npos) << req.target;
    const HttpRequest expected = suite::parse_request(suite::read(c.dir / "query-signed-request.txt"));
    EXPECT_EQ(canonical_query(req.target.substr(req.target.find('?') + 1)),
              canonical_query(expected.target.substr(expected.target.find('?') + 1)));
  }
}

TEST_F(SigV4Suite, CanonicalPiecesOfTheQueryForm) {
  // The query form's canonical request, checked through its pieces for one case with a session token.
  const suite::Case c = suite::load(suite::root() / "get-vanilla-with-session-token");
  HttpRequest req = suite::parse_request(suite::read(c.dir / "request.txt"));
  presign(req, c.creds, c.params);
  const std::string creq = canonical_request(req, {"host"}, true, hex(sha256("")), {"X-Amz-Signature"});
  EXPECT_EQ(creq, trim_end(suite::read(c.dir / "query-canonical-request.txt")));
}

TEST_F(SigV4Suite, SigningKeyIsTheDocumentedDerivation) {
  // AWS documentation example: secret wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY, 20120215/us-east-1/iam.
  EXPECT_EQ(hex(signing_key("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "20120215", "us-east-1", "iam")),
            "f4780e2d9f65fa895f9c67b32ce1baf0b0d8a43505a000a1a9e090d414db404d");
}

TEST_F(SigV4Suite, VerifierAcceptsEverySignedRequest) {
  for (const auto& c : suite::all()) {
    SCOPED_TRACE(c.name);
    VerifyOptions opts;
    opts.normalize_path = c.params.normalize_path;
    opts.unsigned_query_session_token = c.params.omit_session_token;
    const HttpRequest header_req = suite::parse_request(suite::read(c.dir / "header-signed-request.txt"));
    EXPECT_NO_THROW(EXPECT_EQ(verify(header_req, suite_keys(c), c.params.time, opts).access_key_id, "AKIDEXAMPLE"));
    const HttpRequest query_req = suite::parse_request(suite::read(c.dir / "query-signed-request.txt"));
    Identity id;
    EXPECT_NO_THROW(id = verify(query_req, suite_keys(c), c.params.time + std::chrono::seconds(60), opts));
    EXPECT_EQ(id.access_key_id, "AKIDEXAMPLE");
    EXPECT_EQ(id.region, "us-east-1");
    EXPECT_EQ(id.service, "service");
  }
}
