// Opens a TCP socket and tries to connect out.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <cstdio>
int main() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) return 1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(53);
  inet_pton(AF_INET, "1.1.1.1", &a.sin_addr);
  connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  std::puts("PWNED");  // getting a socket at all is the breach
}
