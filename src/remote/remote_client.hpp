// HTTP transport of the remote session: a pool of keep-alive connections, SigV4 or bearer auth, retries with
// jittered exponential backoff, and AWS error decoding into rlloop::remote_error.
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/remote.hpp>

#include "sigv4/sigv4.hpp"

namespace rlloop::detail {

class RemoteClient {
 public:
  explicit RemoteClient(RemoteOptions options);
  ~RemoteClient();

  // Control plane: POST / with X-Amz-Target SageMaker.<op>.
  nlohmann::json control(const std::string& op, const nlohmann::json& body);
  using Headers = std::vector<std::pair<std::string, std::string>>;
  // Runtime REST; body empty for GET. `headers` go out on every attempt (e.g. an Idempotency-Key).
  nlohmann::json rest(const std::string& method, const std::string& target, const std::string& body = "",
                      const Headers& headers = {});
  const RemoteOptions& options() const { return options_; }

 private:
  struct Connection;
  nlohmann::json request(const std::string& method, const std::string& target, const std::string& body,
                         const std::string& amz_target, const Headers& headers = {});
  std::unique_ptr<Connection> take();
  void give_back(std::unique_ptr<Connection> c);

  RemoteOptions options_;
  std::string host_;
  std::string port_;
  sigv4::Credentials creds_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Connection>> idle_;
};

}  // namespace rlloop::detail
