# Tries to see (and kill) the host's processes.
import os, signal
pids = [p for p in os.listdir("/proc") if p.isdigit()]
try:
    os.kill(-1, signal.SIGKILL)  # everything it may signal, except itself
except OSError:
    pass
if len(pids) > 3:
    print("PWNED", len(pids))
