# Tries to allocate and touch 8 GiB.
try:
    blocks = []
    for _ in range(64):
        blocks.append(bytearray(128 << 20))
    print("PWNED")
except MemoryError:
    pass
