# Writes a 1 GiB file in its tmp: the file-size and tmpfs caps must stop it.
import signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
written = 0
try:
    with open("/tmp/big", "wb") as f:
        chunk = b"\0" * (1 << 20)
        for _ in range(1024):
            f.write(chunk)
            written += len(chunk)
except OSError:
    pass
if written >= 256 << 20:
    print("PWNED")
