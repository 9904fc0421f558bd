#!/usr/bin/env python3
"""Memory and restart time of `rlloop serve` as operations accumulate (bounded operation state, compacted journal).

Starts the given rlloop binary as `rlloop serve` (one bearer-key tenant, a temporary data dir, rlloop-tiny on the
CPU), creates one session and runs a training loop on it: forwardBackward (4 sequences of 64 tokens) then
optimizerStep, each with a clientToken, each result fetched (long-poll). Two stages, each printing Markdown rows:

  memory   VmRSS / threads / data-dir size after the first 1,000 operations and onwards up to --operations;
  restart  for each count in --restart-after: a fresh server runs that many operations and is killed with
           SIGKILL; then each is restarted on its data dir (and killed again) in turns, --repeat times; the time
           from exec to its "listening" line is printed for each restart, with the median, beside a server's start
           on an empty data dir. --no-steps: forwardBackward operations only (gradients accumulated, never
           stepped: what a restart rebuilds from the last autosave, docs/wire.md "Crash recovery").

Loopback only, standard library only.

    python3 bench/server/operations.py build/bin/rlloop [--operations 20000] [--restart-after 100 1000 10000]
        [--repeat 5] [--stage memory|restart|both] [--no-steps] [-- serve args...]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import Client, Server, dir_bytes, new_root, remove, status  # noqa: E402

CHECKPOINTS = (1_000, 2_000, 5_000, 10_000, 15_000, 20_000)


def memory(args, serve_args):
    root = new_root("rlloop-bench-ops-")
    server = Server(args.binary, root, serve_args)
    try:
        port, _ = server.start()
        client = Client(port)
        client.create_session()
        print("| operations | threads | resident memory | data dir |")
        print("|---|---|---|---|")
        marks = [n for n in CHECKPOINTS if n <= args.operations] + [args.operations]
        for seq in range(1, args.operations + 1):
            client.operation(seq)
            if seq in marks:
                threads, rss, _ = status(server.pid)
                print(f"| {seq:,} | {threads} | {rss:.0f} MiB | {dir_bytes(server.data) / 2**20:.1f} MiB |",
                      flush=True)
                marks.remove(seq)
    finally:
        server.kill()
        remove(root)


def restart(args, serve_args):
    # Every data dir is prepared first, then restarted in turns, so that each count sees the same machine load.
    roots, servers = [], []
    try:
        for count in args.restart_after:
            roots.append(new_root("rlloop-bench-ops-"))
            servers.append(Server(args.binary, roots[-1], serve_args))
            port, _ = servers[-1].start()
            client = Client(port)
            client.create_session()
            for first in range(1, count + 1, 50):
                client.operations(first, min(50, count + 1 - first), steps=not args.no_steps)
            client.close()
            servers[-1].kill()
        times = [[] for _ in servers]
        empty = []
        for _ in range(args.repeat):
            root = new_root("rlloop-bench-ops-")
            try:
                fresh = Server(args.binary, root, serve_args)
                empty.append(fresh.start()[1])
                fresh.kill()
            finally:
                remove(root)
            for server, seconds in zip(servers, times):
                seconds.append(server.start()[1])
                server.kill()
        kind = "forwardBackward operations" if args.no_steps else "operations"
        print(f"| {kind} before kill -9 | restarts: exec to listening | median | data dir |")
        print("|---|---|---|---|")
        listed = ", ".join(f"{t:.2f}" for t in empty)
        print(f"| (empty data dir: a first start) | {listed} s | {sorted(empty)[len(empty) // 2]:.2f} s | 0 MiB |")
        for count, server, seconds in zip(args.restart_after, servers, times):
            listed = ", ".join(f"{t:.2f}" for t in seconds)
            median = sorted(seconds)[len(seconds) // 2]
            print(f"| {count:,} | {listed} s | {median:.2f} s | {dir_bytes(server.data) / 2**20:.1f} MiB |")
    finally:
        for server in servers:
            server.kill()
        for root in roots:
            remove(root)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--operations", type=int, default=20_000)
    parser.add_argument("--restart-after", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--stage", choices=["memory", "restart", "both"], default="both")
    parser.add_argument("--no-steps", action="store_true")
    args, serve_args = parser.parse_known_args()  # the rest, after --, goes to `rlloop serve`
    serve_args = [a for a in serve_args if a != "--"]
    if args.stage in ("memory", "both"):
        memory(args, serve_args)
    if args.stage in ("restart", "both"):
        restart(args, serve_args)


if __name__ == "__main__":
    sys.exit(main())
