// rlloop::sigv4: a signed request carries an AWS4-HMAC-SHA256 Authorization header.
#include <cstdio>

#include <rlloop/sigv4/sigv4.hpp>

int main() {
  rlloop::sigv4::HttpRequest req{"POST", "/", {{"Host", "example.com"}}, "{}"};
  rlloop::sigv4::sign(req, {"AKIDEXAMPLE", "secret", ""}, {});
  const auto auth = req.header("Authorization").value_or("");
  std::printf("sigv4: %.40s...\n", auth.c_str());
  return auth.rfind("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/", 0) == 0 ? 0 : 1;
}
