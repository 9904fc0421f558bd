#!/usr/bin/env python3
"""Memory and restart time of `rlloop serve` as operations accumulate (bounded operation state, compacted journal).

Starts the given rlloop binary as `rlloop serve` (one bearer-key tenant, a temporary data dir, rlloop-tiny on the
CPU), creates one session and runs a training loop on it: forwardBackward (4 sequences of 64 tokens) then
optimizerStep, each with a clientToken, each result fetched (long-poll). Two stages, each printing Markdown rows:

  memory   VmRSS / threads / data-dir size after the first 1,000 operations and onwards up to --operations;
  restart  for each count in --restart-after: a fresh server runs that many operations and is killed with
           SIGKILL; then each is restarted on its data dir (and killed again) in turns, --repeat times; the time
           from exec to its "listening" line is printed for each restart, with the median.

Loopback only, standard library only.

    python3 bench/server/operations.py build/bin/rlloop [--operations 20000] [--restart-after 100 1000 10000]
        [--repeat 5] [--stage memory|restart|both] [-- serve args...]
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

KEY = "bench-key"
SESSION = "bench"
CHECKPOINTS = (1_000, 2_000, 5_000, 10_000, 15_000, 20_000)


def status(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def datum(seq, i):
    tokens = [(seq * 7 + i * 13 + k) % 250 + 1 for k in range(65)]
    return {
        "modelInput": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "lossFnInputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [64]},
            "weights": {"data": [1.0] * 64, "dtype": "float32", "shape": [64]},
        },
    }


class Client:
    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def call(self, method, path, body=None, target=None):
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        if target:
            headers["X-Amz-Target"] = "SageMaker." + target
            headers["Content-Type"] = "application/x-amz-json-1.1"
        self.conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{method} {path}: {r.status} {data[:300]!r}")
        return json.loads(data)

    def create_session(self):
        self.call("POST", "/", {
            "TrainingSessionName": SESSION, "RoleArn": "arn:aws:iam::000000000000:role/Bench",
            "LoraConfig": {"Rank": 4, "Alpha": 8}, "ModelConfig": {"BaseModelArn": "rlloop-tiny"},
            "OutputConfig": {"S3Location": {"Path": "s3://bench/out/"}}}, target="CreateTrainingSession")
        while self.call("POST", "/", {"TrainingSessionName": SESSION}, target="DescribeTrainingSession")[
                "TrainingSessionDetail"]["TrainingSessionStatus"] != "Running":
            time.sleep(0.05)

    def operation(self, seq):
        """One training operation, sequence number seq: forwardBackward when odd, optimizerStep when even."""
        if seq % 2:
            config = {"forwardBackward": {"datumList": [datum(seq, i) for i in range(4)],
                                          "lossFnName": "cross_entropy"}}
        else:
            config = {"optimizerStep": {"adamParamsConfig": {"learningRate": 1e-4}}}
        path = f"/v1/training-sessions/{SESSION}/operations"
        op = self.call("POST", path, {"sequenceNumber": seq, "clientToken": f"bench-{seq}",
                                      "operationConfig": config})["operationId"]
        result = self.call("GET", f"{path}/{op}?waitSeconds=20")
        if result["status"] != "Completed":
            raise RuntimeError(f"operation {seq}: {result}")


class Server:
    def __init__(self, binary, root, serve_args):
        self.cmd = [binary, "serve", "--port", "0", "--threads", "1", "--device", "cpu",
                    "--tenants", os.path.join(root, "tenants.json"), "--data-dir", os.path.join(root, "data"),
                    *serve_args]
        self.data = os.path.join(root, "data")
        self.proc = None

    def start(self):
        """Starts the server; returns (port, seconds from exec to its listening line)."""
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            if '"event":"listening"' in line:
                return json.loads(line)["port"], time.monotonic() - t0
        raise RuntimeError("the server exited before listening")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def new_root():
    root = tempfile.mkdtemp(prefix="rlloop-bench-ops-")
    with open(os.path.join(root, "tenants.json"), "w") as f:
        json.dump({"tenants": [{"id": "bench", "bearerKeys": [KEY], "maxSessions": 1}]}, f)
    return root


def memory(args, serve_args):
    root = new_root()
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
                threads, rss = status(server.proc.pid)
                print(f"| {seq:,} | {threads} | {rss:.0f} MiB | {dir_bytes(server.data) / 2**20:.1f} MiB |",
                      flush=True)
                marks.remove(seq)
    finally:
        if server.proc:
            server.kill()
        shutil.rmtree(root, ignore_errors=True)


def restart(args, serve_args):
    # Every data dir is prepared first, then restarted in turns, so that each count sees the same machine load.
    roots, servers = [], []
    try:
        for count in args.restart_after:
            roots.append(new_root())
            servers.append(Server(args.binary, roots[-1], serve_args))
            port, _ = servers[-1].start()
            client = Client(port)
            client.create_session()
            for seq in range(1, count + 1):
                client.operation(seq)
            servers[-1].kill()
        times = [[] for _ in servers]
        for _ in range(args.repeat):
            for server, seconds in zip(servers, times):
                seconds.append(server.start()[1])
                server.kill()
        print("| operations before kill -9 | restarts: exec to listening | median | data dir |")
        print("|---|---|---|---|")
        for count, server, seconds in zip(args.restart_after, servers, times):
            listed = ", ".join(f"{t:.2f}" for t in seconds)
            median = sorted(seconds)[len(seconds) // 2]
            print(f"| {count:,} | {listed} s | {median:.2f} s | {dir_bytes(server.data) / 2**20:.1f} MiB |")
    finally:
        for server in servers:
            if server.proc and server.proc.poll() is None:
                server.kill()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--operations", type=int, default=20_000)
    parser.add_argument("--restart-after", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--stage", choices=["memory", "restart", "both"], default="both")
    args, serve_args = parser.parse_known_args()  # the rest, after --, goes to `rlloop serve`
    serve_args = [a for a in serve_args if a != "--"]
    if args.stage in ("memory", "both"):
        memory(args, serve_args)
    if args.stage in ("restart", "both"):
        restart(args, serve_args)


if __name__ == "__main__":
    sys.exit(main())
