# Floods stdout (after the expected answer): the output cap must stop it.
import sys
print("PWNED")
chunk = "x" * 65536
while True:
    sys.stdout.write(chunk)
