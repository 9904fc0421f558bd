# Double-fork daemon that should outlive the run and keep writing; PWNED if the first fork worked.
import os, time
try:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                with open("/tmp/daemon_alive", "w") as f:
                    f.write("x")
                time.sleep(0.1)
        os._exit(0)
    print("PWNED")
except OSError:
    pass
