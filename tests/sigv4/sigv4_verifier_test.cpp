// The verifier rejects what it must, with the AWS error name.
#include <gtest/gtest.h>

#include "suite.hpp"

using namespace rlloop::sigv4;

namespace {

const Credentials kCreds{"AKIDTENANTA", "secret-a", ""};
const auto kNow = parse_iso8601("2026-11-20T12:00:00Z");

SecretLookup keys() {
  return [](const std::string& akid) -> std::optional<std::string> {
    if (akid == "AKIDTENANTA") return std::string("secret-a");
    if (akid == "AKIDTENANTB") return std::string("secret-b");
    return std::nullopt;
  };
}

HttpRequest signed_post(clock::time_point when = kNow, const Credentials& creds = kCreds) {
  HttpRequest req{"POST",
                  "/v1/training-sessions/s1/operations",
                  {{"Host", "127.0.0.1:8080"}, {"Content-Type", "application/json"}},
                  R"({"sequenceNumber":1})"};
  SigningParams p;
  p.time = when;
  p.sign_body = true;
  sign(req, creds, p);
  return req;
}

std::string code_of(const HttpRequest& req, clock::time_point now = kNow) {
  try {
    verify(req, keys(), now);
  } catch (const auth_error& e) {
    EXPECT_EQ(e.http_status(), 403);
    return e.code();
  }
  return "accepted";
}

}  // namespace

TEST(SigV4Verifier, AcceptsAValidRequestAndNamesTheKey) {
  const Identity id = verify(signed_post(), keys(), kNow);
  EXPECT_EQ(id.access_key_id, "AKIDTENANTA");
  EXPECT_EQ(id.service, "sagemaker");
  EXPECT_EQ(code_of(signed_post(kNow, {"AKIDTENANTB", "secret-b", ""})), "accepted");
}

TEST(SigV4Verifier, RejectsTampering) {
  HttpRequest body = signed_post();
  body.body = R"({"sequenceNumber":2})";
  EXPECT_EQ(code_of(body), "SignatureDoesNotMatch");

  HttpRequest path = signed_post();
  path.target = "/v1/training-sessions/s2/operations";
  EXPECT_EQ(code_of(path), "SignatureDoesNotMatch");

  HttpRequest header = signed_post();
  header.set_header("Content-Type", "text/plain");
  EXPECT_EQ(code_of(header), "SignatureDoesNotMatch");

  HttpRequest sig = signed_post();
  std::string auth = *sig.header("Authorization");
  auth.back() = auth.back() == '0' ? '1' : '0';
  sig.set_header("Authorization", auth);
  EXPECT_EQ(code_of(sig), "SignatureDoesNotMatch");
}

TEST(SigV4Verifier, RejectsWrongOrUnknownKeys) {
  EXPECT_EQ(code_of(signed_post(kNow, {"AKIDTENANTA", "secret-b", ""})), "SignatureDoesNotMatch");
  EXPECT_EQ(code_of(signed_post(kNow, {"AKIDNOBODY", "secret-a", ""})), "UnrecognizedClientException");
}

TEST(SigV4Verifier, RejectsSkewedAndExpiredRequests) {
  EXPECT_EQ(code_of(signed_post(kNow - std::chrono::minutes(16))), "InvalidSignatureException");
  EXPECT_EQ(code_of(signed_post(kNow + std::chrono::minutes(16))), "InvalidSignatureException");
  EXPECT_EQ(code_of(signed_post(kNow - std::chrono::minutes(14))), "accepted");

  HttpRequest url{"GET", "/v1/training-sessions/s1/operations/op-1", {{"Host", "127.0.0.1"}}, ""};
  SigningParams p;
  p.time = kNow;
  p.expires = std::chrono::seconds(60);
  presign(url, kCreds, p);
  EXPECT_EQ(code_of(url, kNow + std::chrono::seconds(59)), "accepted");
  EXPECT_EQ(code_of(url, kNow + std::chrono::seconds(61)), "InvalidSignatureException");
}

TEST(SigV4Verifier, RejectsIncompleteOrMissingSignatures) {
  HttpRequest none{"GET", "/health", {{"Host", "x"}}, ""};
  EXPECT_EQ(code_of(none), "MissingAuthenticationToken");

  HttpRequest basic = none;
  basic.set_header("Authorization", "Basic dXNlcjpwYXNz");
  EXPECT_EQ(code_of(basic), "IncompleteSignature");

  HttpRequest no_sig = signed_post();
  std::string auth = *no_sig.header("Authorization");
  no_sig.set_header("Authorization", auth.substr(0, auth.find(", Signature=")));
  EXPECT_EQ(code_of(no_sig), "IncompleteSignature");

  HttpRequest no_date = signed_post();
  std::erase_if(no_date.headers, [](const auto& h) { return h.first == "X-Amz-Date"; });
  EXPECT_EQ(code_of(no_date), "IncompleteSignature");

  HttpRequest bad_scope = signed_post();
  auth = *bad_scope.header("Authorization");
  bad_scope.set_header("Authorization", auth.replace(auth.find("Credential=") + 11, 11, "AKIDTENANTA/x"));
  EXPECT_EQ(code_of(bad_scope), "IncompleteSignature");
}

TEST(SigV4Verifier, RejectsAServiceOutsideTheAllowedOne) {
  VerifyOptions opts;
  opts.service = "execute-api";
  try {
    verify(signed_post(), keys(), kNow, opts);
    FAIL();
  } catch (const auth_error& e) {
    EXPECT_EQ(e.code(), "SignatureDoesNotMatch");
    EXPECT_NE(std::string(e.what()).find("'sagemaker'"), std::string::npos);
  }
}
