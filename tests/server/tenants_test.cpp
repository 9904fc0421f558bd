#include <gtest/gtest.h>

#include "server/server.hpp"

using namespace rlloop;

TEST(Tenants, ParsesKeysAndLimits) {
  const auto t = server::parse_tenants(R"({"tenants": [
    {"id": "a", "accountId": "111122223333", "accessKeys": [{"accessKeyId": "AKIDA", "secretAccessKey": "sa"}],
     "maxSessions": 2, "maxBodyBytes": 4096},
    {"id": "b", "bearerKeys": ["key-b"]}]})");
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].account_id, "111122223333");
  EXPECT_EQ(t[0].access_keys.at(0).second, "sa");
  EXPECT_EQ(t[0].max_sessions, 2u);
  EXPECT_EQ(t[0].max_body_bytes, 4096u);
  EXPECT_EQ(t[1].bearer_keys.at(0), "key-b");
}

TEST(Tenants, RejectsBadFilesNamingTheField) {
  auto msg = [](const std::string& text) {
    try {
      server::parse_tenants(text, "t.json");
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(msg(R"({"tenants": [{"id": "a"}]})"), "t.json: tenants[0]: tenant has neither accessKeys nor bearerKeys");
  EXPECT_EQ(msg(R"({"tenants": [{"id": "a", "bearerKeys": ["k"]}, {"id": "b", "bearerKeys": ["k"]}]})"),
            "t.json: tenants[1].bearerKeys[0]: key is used by more than one tenant entry");
  EXPECT_EQ(msg(R"({"tenants": [{"id": "a", "bearerKeys": ["k"], "accountId": "12"}]})"),
            "t.json: tenants[0].accountId: must be 12 digits");
  EXPECT_EQ(msg(R"({"tenants": [{"id": "a", "bearerKeys": ["k"], "quota": 1}]})"),
            "t.json: tenants[0].quota: unknown field");
  EXPECT_NE(msg("{").find("t.json: not valid JSON"), std::string::npos);
  EXPECT_THROW(server::load_tenants("/nonexistent/tenants.json"), io_error);
}
