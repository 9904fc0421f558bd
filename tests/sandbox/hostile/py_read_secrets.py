# Looks for credentials: host files, the grader's environment, other processes' environments.
import os, glob
found = []
for path in ["@HOST_DIR@/secret.txt", "/etc/shadow", "/root/.ssh/id_rsa", "/root/.aws/credentials",
             "/root/.bash_history", "/etc/passwd", "/home"]:
    try:
        if os.path.isdir(path):
            if os.listdir(path):
                found.append(path)
        else:
            with open(path, errors="replace") as f:
                data = f.read()
            if data:
                found.append(path)
    except OSError:
        pass
if "@SECRET@" in str(os.environ):
    found.append("environ")
for env in glob.glob("/proc/*/environ"):
    try:
        with open(env, "rb") as f:
            if b"@SECRET@" in f.read():
                found.append(env)
    except OSError:
        pass
if found:
    print("PWNED", found)
