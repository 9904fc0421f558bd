# Uses no CPU, so only the wall-clock deadline can stop it.
import time
time.sleep(3600)
print("PWNED")
