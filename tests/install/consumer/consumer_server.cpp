// rlloop::server: a server with one tenant and no sessions answers its health check through the Api.
#include <cstdio>

#include <rlloop/server/server.hpp>

int main() {
  rlloop::server::Options options;
  options.tenants = {rlloop::server::Tenant{"t", "111122223333", {}, {"key"}}};
  options.log = [](const std::string&) {};
  rlloop::server::Server server(options, rlloop::server::Backend{});
  server.start();
  const bool listening = server.port() != 0;
  server.stop();
  std::printf("server: listened on a port: %s\n", listening ? "yes" : "no");
  return listening ? 0 : 1;
}
