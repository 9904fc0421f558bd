# Tries to open network sockets and reach the outside or the host's loopback.
import socket
ok = []
for family, addr in [(socket.AF_INET, ("1.1.1.1", 53)), (socket.AF_INET, ("127.0.0.1", 22)),
                     (socket.AF_INET6, ("::1", 22))]:
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
        ok.append("socket")
        s.settimeout(1)
        s.connect(addr)
        ok.append(addr)
    except OSError:
        pass
if ok:
    print("PWNED", ok)
