#!/usr/bin/env python3
"""Soak test of `rlloop serve` (issue 14, "What it must show" 1): threads and resident memory stay bounded.

One `rlloop serve` process (rlloop-tiny on the CPU, one bearer-key tenant, `--threads 1`, loopback, port 0) with one
training session, then three workloads in turn:

  requests    N requests (GET /v1/usage), each on its own connection (Connection: close);
  operations  N small training operations on the session, alternately forwardBackward (--rows sequences of
              --tokens tokens) and optimizerStep, each with a clientToken, on one keep-alive connection: --window
              submissions sent at once (pipelined), then their results fetched the same way (long-poll);
  idle        N idle keep-alive connections, each served one request and then held open, all together; then
              closed.

Threads and VmRSS (/proc/PID/status) are recorded once the session exists and the server is idle, after the first
1,000 (--mark; all, when fewer) of each workload and at its end. It checks that every request was answered 200 and
its connection closed by the server, every operation ended Completed, the idle connections were all held open by
the server at once and all closed afterwards (its socket count, /proc/PID/fd, back to the idle one); and then that
the thread count is back to the idle value and VmRSS is within --rss-slack-mib (64) of each value recorded after a
first 1,000. No assertion depends on how long anything takes. It prints a Markdown table of every stage.

The data dir is on /dev/shm where there is one (--data-parent): with the journal's fdatasync per record on a
virtual disk an operation took 7-30 ms here (2-3 ms on tmpfs), so 20,000 would take 3-10 minutes rather than about
one; durability is not what this measures (tests/server/crash_test.cpp and journal_test.cpp do), and a tmpfs
file's pages are not in the server's VmRSS.

    python3 tests/server/soak_test.py build/bin/rlloop [--requests 20000] [--operations 20000] [--idle 2000]
        [--rows 1] [--tokens 16] [--window 100] [--mark 1000] [--rss-slack-mib 64] [-- more serve args]

Exit status 0 when every check holds, 1 otherwise. Standard library only.
"""
import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "server"))
from serve_bench import Client, Server, new_root, remove, settle, sockets, status, usage_once  # noqa: E402


def wait_for(predicate, seconds):
    """Polls predicate() until it holds or `seconds` pass; returns whether it held (a bound on an event, which the
    caller asserts, not a measure of how fast it came)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--operations", type=int, default=20_000)
    parser.add_argument("--idle", type=int, default=2_000)
    parser.add_argument("--rows", type=int, default=1, help="sequences per forwardBackward")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--window", type=int, default=100, help="operations submitted at once (<= 1,000, the "
                        "results a session retains)")
    parser.add_argument("--mark", type=int, default=1_000, help="memory is compared with its value after this many "
                        "of each workload")
    parser.add_argument("--rss-slack-mib", type=float, default=64)
    parser.add_argument("--data-parent", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None,
                        help="where the temporary data dir goes (default /dev/shm when writable, else the system's "
                        "temporary directory)")
    args, serve_args = parser.parse_known_args()  # the rest, after --, goes to `rlloop serve`
    serve_args = [a for a in serve_args if a != "--"]
    if not 1 <= args.window <= 1_000:
        parser.error("--window must be in [1, 1000]")

    # The idle connections are held all at once: room for them under the server's cap and this process's fds.
    # A long idle timeout, so that none is closed by the server before all are open however slow the machine.
    serve_args = ["--max-connections", str(args.idle + 64), "--idle-timeout-ms", str(3_600_000), *serve_args]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < args.idle + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard == resource.RLIM_INFINITY else
                                                    min(hard, max(soft, args.idle + 256)), hard))

    failures = []

    def check(ok, what):
        print(f"{'ok' if ok else 'FAILED'}: {what}", flush=True)
        if not ok:
            failures.append(what)

    root = new_root("rlloop-soak-", args.data_parent)
    server = Server(args.binary, root, serve_args)
    t0 = time.monotonic()
    rows, marks = [], {}

    def record(what, mark=None, count=None):
        threads, rss, vm = settle(server.pid)
        rows.append((what, threads, rss, vm, sockets(server.pid), time.monotonic() - t0))
        print(f"[{rows[-1][5]:6.1f} s] {what}: {threads} threads, {rss:.1f} MiB resident", flush=True)
        if mark:
            marks[mark] = (count, rss)
        return threads, rss

    try:
        port, _ = server.start()
        with Client(port) as c:
            c.create_session()
        # The session's model is loaded and no client is connected: the idle state.
        idle_threads, _ = record("idle: session Running, no connection")
        idle_sockets = sockets(server.pid)

        # 1. Requests, each on its own connection: usage_once raises unless the answer is a 200 and the server
        # then closes the connection.
        served = 0
        for _ in range(args.requests):
            usage_once(port, keep_alive=False)
            served += 1
            if served == min(args.mark, args.requests):
                record(f"{served:,} requests, each on its own connection", mark="requests", count=served)
        record(f"{served:,} requests, each on its own connection")
        check(served == args.requests, f"{served:,} of {args.requests:,} requests on their own connection got a 200 "
                                       "and were closed by the server")

        # 2. Small training operations, pipelined on one keep-alive connection: operations() raises unless every
        # submission is a 200 and every result Completed.
        completed, mark = 0, min(args.mark, args.operations)
        with Client(port) as c:
            while completed < args.operations:
                n = min(args.window, args.operations - completed, mark - completed if completed < mark else args.window)
                c.operations(completed + 1, n, args.rows, args.tokens)
                completed += n
                if completed == mark:
                    record(f"{completed:,} training operations", mark="operations", count=completed)
        record(f"{completed:,} training operations")
        check(completed == args.operations, f"{completed:,} of {args.operations:,} training operations Completed")

        # 3. Idle keep-alive connections, all held open at once, then closed.
        idle = []
        try:
            for _ in range(args.idle):
                idle.append(usage_once(port, keep_alive=True))
                if len(idle) == min(args.mark, args.idle):
                    record(f"{len(idle):,} idle connections held open", mark="idle", count=len(idle))
            held = wait_for(lambda: sockets(server.pid) >= idle_sockets + len(idle), 60)
            record(f"{len(idle):,} idle connections held open")
            check(len(idle) == args.idle and held,
                  f"{len(idle):,} of {args.idle:,} idle connections got a 200 and are held open by the server "
                  f"({sockets(server.pid) - idle_sockets:,} more sockets than idle)")
        finally:
            for c in idle:
                c.close()
        closed = wait_for(lambda: sockets(server.pid) == idle_sockets, 60)
        final_threads, final_rss = record("... and closed")
        check(closed, f"the server closed them all (its sockets back to the idle {idle_sockets}: "
                      f"{sockets(server.pid)})")

        # The bounds themselves.
        check(final_threads == idle_threads, f"threads at the end {final_threads} == idle {idle_threads}")
        for name, (count, rss) in marks.items():
            check(final_rss <= rss + args.rss_slack_mib,
                  f"resident memory at the end {final_rss:.1f} MiB <= after the first {count:,} {name} "
                  f"{rss:.1f} MiB + {args.rss_slack_mib:g} MiB")
        check(len(marks) == 3, f"resident memory recorded after the first {args.mark:,} (or all) of each workload")
        check(server.alive(), "the server is still running")
    except Exception as e:  # an unexpected answer or a dead server: report it as a failure, with the table so far
        check(False, f"{type(e).__name__}: {e}")
    finally:
        server.kill()
        log = open(os.path.join(root, "serve.log")).read() if os.path.exists(os.path.join(root, "serve.log")) else ""
        remove(root)

    print()
    print(f"`rlloop serve --threads 1`, rlloop-tiny, one session; forwardBackward of {args.rows} x {args.tokens} "
          f"tokens alternating with optimizerStep, {args.window} pipelined")
    print()
    print("| stage | threads | resident memory | virtual memory | server sockets | elapsed |")
    print("|---|---|---|---|---|---|")
    for what, threads, rss, vm, socks, t in rows:
        print(f"| {what} | {threads} | {rss:.0f} MiB | {vm:.1f} GiB | {socks:,} | {t:.0f} s |")
    print()
    if failures:
        print("server log (last 4,000 characters):\n" + log[-4000:])
        print(f"{len(failures)} check(s) FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
