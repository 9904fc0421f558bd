# Burns CPU forever: must be stopped by the CPU limit.
while True:
    pass
print("PWNED")
