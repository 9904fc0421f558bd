#!/usr/bin/env python3
"""Threads and memory of `rlloop serve` as connections come and go (issue 14, point 1).

Starts the given rlloop binary as `rlloop serve` (one bearer-key tenant, no sessions, a temporary data dir), then:
N requests each on its own connection (Connection: close), M idle keep-alive connections held open (each served
one request first), then those closed. After each stage it prints the server's Threads, VmRSS and VmSize from
/proc/PID/status as a Markdown table row. Loopback only, standard library only.

    python3 bench/server/connections.py build/bin/rlloop [--requests 2000] [--idle 1000] [-- serve args...]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import Server, new_root, remove, settle, usage_once  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--idle", type=int, default=1000)
    args, serve_args = parser.parse_known_args()  # the rest, after --, goes to `rlloop serve`
    serve_args = [a for a in serve_args if a != "--"]

    root = new_root("rlloop-bench-conn-")
    server = Server(args.binary, root, serve_args, device=None)
    try:
        port, _ = server.start()
        print("| what was done | threads | resident memory | virtual memory |")
        print("|---|---|---|---|")

        def row(what):
            threads, rss, vm = settle(server.pid)
            print(f"| {what} | {threads} | {rss:.0f} MiB | {vm:.1f} GiB |", flush=True)

        usage_once(port, keep_alive=False)
        row("start (one request served)")
        for _ in range(args.requests):
            usage_once(port, keep_alive=False)
        row(f"{args.requests:,} requests, each on its own connection")
        idle = [usage_once(port, keep_alive=True) for _ in range(args.idle)]
        row(f"{args.idle:,} idle keep-alive connections held open")
        for c in idle:
            c.close()
        row("... and closed")
    finally:
        server.kill()
        remove(root)


if __name__ == "__main__":
    sys.exit(main())
