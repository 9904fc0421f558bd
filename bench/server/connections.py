#!/usr/bin/env python3
"""Threads and memory of `rlloop serve` as connections come and go (issue 14, point 1).

Starts the given rlloop binary as `rlloop serve` (one bearer-key tenant, no sessions, a temporary data dir), then:
N requests each on its own connection (Connection: close), M idle keep-alive connections held open (each served
one request first), then those closed. After each stage it prints the server's Threads, VmRSS and VmSize from
/proc/PID/status as a Markdown table row. Loopback only, standard library only.

    python3 bench/server/connections.py build/bin/rlloop [--requests 2000] [--idle 1000] [-- serve args...]
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

KEY = "bench-key"


def status(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    kib = lambda k: int(fields[k].split()[0])
    return int(fields["Threads"]), kib("VmRSS") / 1024, kib("VmSize") / 1024 / 1024


def request(sock, keep_alive):
    connection = "keep-alive" if keep_alive else "close"
    sock.sendall(
        f"GET /v1/usage HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nConnection: {connection}\r\n\r\n"
        .encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode(errors="replace"))


def settle(pid, seconds=5.0):
    """Waits until the thread count stops changing (a server may take a moment to see its clients leave)."""
    last, deadline = None, time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = status(pid)[0]
        if now == last:
            break
        last = now
        time.sleep(0.25)
    return status(pid)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--idle", type=int, default=1000)
    args, serve_args = parser.parse_known_args()  # the rest, after --, goes to `rlloop serve`
    serve_args = [a for a in serve_args if a != "--"]

    root = tempfile.mkdtemp(prefix="rlloop-bench-conn-")
    with open(os.path.join(root, "tenants.json"), "w") as f:
        json.dump({"tenants": [{"id": "bench", "bearerKeys": [KEY], "maxSessions": 1}]}, f)
    server = subprocess.Popen(
        [args.binary, "serve", "--port", "0", "--threads", "1", "--tenants", os.path.join(root, "tenants.json"),
         "--data-dir", os.path.join(root, "data"), *serve_args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = json.loads(server.stdout.readline())["port"]
        connect = lambda: socket.create_connection(("127.0.0.1", port))
        print("| what was done | threads | resident memory | virtual memory |")
        print("|---|---|---|---|")

        def row(what):
            threads, rss, vm = settle(server.pid)
            print(f"| {what} | {threads} | {rss:.0f} MiB | {vm:.1f} GiB |", flush=True)

        with connect() as s:
            request(s, keep_alive=False)
        row("start (one request served)")
        for _ in range(args.requests):
            with connect() as s:
                request(s, keep_alive=False)
        row(f"{args.requests:,} requests, each on its own connection")
        idle = []
        for _ in range(args.idle):
            s = connect()
            request(s, keep_alive=True)
            idle.append(s)
        row(f"{args.idle:,} idle keep-alive connections held open")
        for s in idle:
            s.close()
        row("... and closed")
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
