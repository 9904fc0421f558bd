// rlloop::remote: a service client for an endpoint, through the same Service concept as the local one.
#include <cstdio>

#include <rlloop/remote.hpp>

int main() {
  rlloop::RemoteOptions options;
  options.endpoint = "http://127.0.0.1:8080";
  options.bearer_key = "key";  // nothing is sent: making the client checks its settings only
  rlloop::RemoteService service(options);
  static_assert(rlloop::Service<rlloop::RemoteService>);
  std::printf("remote: a client for %s\n", options.endpoint.c_str());
  return 0;
}
