# Tries to create files everywhere outside its private tmp, including a world-writable host folder.
import os
targets = ["@HOST_DIR@/pwned_py", "/usr/pwned_py", "/etc/pwned_py", "/root/pwned_py", "/pwned_py",
           "/box/pwned_py", "/var/tmp/pwned_py", "/home/pwned_py", "/proc/pwned_py", "/sys/pwned_py"]
ok = []
for t in targets:
    try:
        os.makedirs(os.path.dirname(t), exist_ok=True)
        with open(t, "w") as f:
            f.write("pwned")
        ok.append(t)
    except OSError:
        pass
# Writing its own tmp is allowed, and must not reach the host's /tmp.
with open("/tmp/rlloop_hostile_private_tmp", "w") as f:
    f.write("fine")
if ok:
    print("PWNED", ok)
