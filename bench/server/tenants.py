#!/usr/bin/env python3
"""Many tenants on one base model (issue 15, "What it must show" points 1-3), measured in one run of `rlloop serve`.

Starts the given rlloop binary as `rlloop serve --threads 2 --device cpu` (one tenant with a SigV4 access key, as
tests/aws/rlloop_serve.py sets it up; a temporary data dir) and talks to it through the wire API only (SageMaker's
control plane and training-session runtime, every request signed with botocore's SigV4 signer), so it measures
any engine behind the server:

  memory      LoRA sessions (rank 8) are created through CreateTrainingSession, K = 1, 2, 4, 8 of them; each new
              session first samples 1 token (its model is then really loaded), then VmRSS is read from
              /proc/PID/status (before that K's sampling round, and after it). Printed per K, with the ratio
              K=8 / K=1 of the first (target <= 1.25x).
  sampling    at each K, every session submits at the same moment (a barrier across one thread per session)
              one sample request of 2 samples x 64 new tokens (seed per session, temperature 1, no stop
              sequences, the same 16-token prompt); aggregate generated tokens / wall time from the first
              submit to the last result. Then one session asks for 16 rows (numSamples 16) in one request, and
              one session submits 8 requests of 2 x 64 before fetching any result (a GRPO step's pattern).
              Targets: K=8 >= 0.75x the 16-row figure, and every K >= K=1.
  training    with all sessions present, 1, 4 and 8 sessions each submit at the same moment 2 forwardBackward
              operations of 8 x 64 tokens (cross_entropy); aggregate training tokens / wall time against one
              session alone (target >= 0.9x at 4 and 8). Each session first runs one small forwardBackward
              alone (warm-up, not timed).

Results are fetched with rlloop's long-poll (`Get*OperationResult?waitSeconds=20`, docs/wire.md), which answers
as soon as the operation is terminal, so the wall times carry no polling delay. Generated tokens are counted
from the results (a row that meets EOS early counts what it produced); training tokens from `tokenUsage`.
Prints the command, the machine's state and Markdown tables (for bench/server/README.md and bench/README.md).

Needs botocore: run it with third_party/venv's Python (scripts/setup.sh --tests).

    third_party/venv/bin/python bench/server/tenants.py build/bin/rlloop [--model rlloop-100m] [--quick]
        [--max-k 8] [--rank 8] [--threads 2] [--samples 2] [--sample-tokens 64] [--train-steps 2] [--train-rows 8]
        [--train-tokens 64] [--train-k 1 4 8] [-- serve args...]

--quick is a smoke run (rlloop-tiny, 2 x 16 new tokens, forwardBackward of 4 x 16): its figures are mostly HTTP and
Python overhead. The default run (rlloop-100m) took 4 min on 2 shared cores with the engine of the shared-base
rewrite; the per-session engine of 8ceec65 trains 8 contending sessions far slower (issue 15: ~43 tokens/s at 4).
"""
import argparse
import datetime
import http.client
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True  # the import below is of tests/aws/rlloop_serve.py: leave no __pycache__ there
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "aws"))
try:
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
except ImportError:
    sys.exit("tenants.py needs botocore: run it with third_party/venv/bin/python (scripts/setup.sh --tests)")
from rlloop_serve import ACCESS_KEY, ACCOUNT, REGION, ROLE_ARN, SECRET_KEY, hub_model_arn  # noqa: E402

PROMPT = [72, 101, 108, 108, 111, 44, 32, 116, 101, 110, 97, 110, 116, 115, 33, 32]  # "Hello, tenants! ", 16 tokens
WAIT = 20  # seconds per long-poll (the most rlloop accepts)


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Client:
    """One keep-alive connection, every request SigV4-signed by botocore (service `sagemaker`)."""

    def __init__(self, port):
        self.port = port
        self.signer = SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY), "sagemaker", REGION)
        self.conn = None

    def call(self, method, path, body=None, target=None, headers=None):
        data = b"" if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if target:
            hdrs["X-Amz-Target"] = "SageMaker." + target
            hdrs["Content-Type"] = "application/x-amz-json-1.1"
        for attempt in range(3):
            req = AWSRequest(method=method, url=f"http://127.0.0.1:{self.port}{path}", data=data, headers=hdrs)
            self.signer.add_auth(req)
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT + 120)
                self.conn.request(method, path, body=data, headers=dict(req.headers.items()))
                r = self.conn.getresponse()
                payload = r.read()
            except (ConnectionError, http.client.HTTPException):
                # A keep-alive connection the server closed while idle; every submit carries a client token
                # or Idempotency-Key, so a retry never runs an operation twice.
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
                continue
            if r.status == 503 and attempt < 2:
                time.sleep(1)
                continue
            if r.status != 200:
                raise RuntimeError(f"{method} {path}: {r.status} {payload[:400]!r}")
            return json.loads(payload or b"{}")

    def control(self, target, body):
        return self.call("POST", "/", body, target=target)

    def result(self, path):
        """Long-polls an operation until it is terminal; returns its state."""
        while True:
            state = self.call("GET", f"{path}?waitSeconds={WAIT}")
            if state["status"] in ("Completed", "Failed", "Skipped"):
                if state["status"] != "Completed":
                    raise RuntimeError(f"{path}: {state['status']}: {state.get('errorDetails')}")
                return state


class Session:
    def __init__(self, port, name):
        self.client = Client(port)
        self.name = name
        self.seq = 0
        self.samples = 0
        self.base = f"/v1/training-sessions/{name}"

    def create(self, model, rank):
        self.client.control("CreateTrainingSession", {
            "TrainingSessionName": self.name, "RoleArn": ROLE_ARN,
            "LoraConfig": {"Rank": rank, "Alpha": 2 * rank},
            "ModelConfig": {"BaseModelArn": hub_model_arn(model)},
            "OutputConfig": {"S3Location": {"Path": "s3://rlloop-bench/out/"}}})
        while True:
            status = self.client.control("DescribeTrainingSession", {"TrainingSessionName": self.name})[
                "TrainingSessionDetail"]["TrainingSessionStatus"]
            if status == "Running":
                return
            if status not in ("Created", "Scheduled", "Blocked"):
                raise RuntimeError(f"session {self.name} is {status}")
            time.sleep(0.05)

    def submit_sample(self, num_samples, max_tokens, seed):
        self.samples += 1
        op = self.client.call("POST", f"{self.base}/sampling-operations", {"operationConfig": {"sample": {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}, "numSamples": num_samples,
            "samplingParams": {"maxTokens": max_tokens, "temperature": 1.0, "seed": seed}}}},
            headers={"Idempotency-Key": f"{self.name}-sample-{self.samples}"})["operationId"]
        return f"{self.base}/sampling-operations/{op}"

    def sampled_tokens(self, path):
        sequences = self.client.result(path)["operationResult"]["sample"]["sequences"]
        return sum(len(s["tokens"]) for s in sequences)

    def submit_forward_backward(self, rows, length):
        self.seq += 1
        data = []
        for i in range(rows):
            tokens = [(self.seq * 31 + i * 17 + k * 7) % 250 + 1 for k in range(length + 1)]
            data.append({"modelInput": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                         "lossFnInputs": {
                             "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [length]},
                             "weights": {"data": [1.0] * length, "dtype": "float32", "shape": [length]}}})
        op = self.client.call("POST", f"{self.base}/operations", {
            "sequenceNumber": self.seq, "clientToken": f"{self.name}-fb-{self.seq}",
            "operationConfig": {"forwardBackward": {"datumList": data, "lossFnName": "cross_entropy"}}})["operationId"]
        return f"{self.base}/operations/{op}", rows * length

    def trained_tokens(self, path, expected):
        state = self.client.result(path)
        usage = state.get("tokenUsage") or state["operationResult"]["forwardBackward"].get("tokenUsage") or {}
        return usage.get("trainingTokens", expected)


def together(sessions, work):
    """Runs work(session) on one thread per session, all released by one barrier at the same moment.
    work returns (first submit time, units done); returns (total units, wall from the first submit to the last
    result, each session's own time from its submit to its last result)."""
    barrier = threading.Barrier(len(sessions))
    out, errors = [None] * len(sessions), []

    def run(i, s):
        try:
            barrier.wait()
            t0, units = work(s)
            out[i] = (t0, time.monotonic(), units)
        except Exception as e:  # reported below, after every thread finished
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    start, end = min(o[0] for o in out), max(o[1] for o in out)
    return sum(o[2] for o in out), end - start, [o[1] - o[0] for o in out]


class Server:
    def __init__(self, binary, threads, serve_args, max_sessions):
        self.dir = tempfile.mkdtemp(prefix="rlloop-bench-tenants-")
        with open(os.path.join(self.dir, "tenants.json"), "w") as f:
            json.dump({"tenants": [{"id": "bench", "accountId": ACCOUNT, "maxSessions": max_sessions,
                                    "accessKeys": [{"accessKeyId": ACCESS_KEY, "secretAccessKey": SECRET_KEY}]}]}, f)
        self.cmd = [binary, "serve", "--tenants", os.path.join(self.dir, "tenants.json"), "--port", "0",
                    "--data-dir", os.path.join(self.dir, "data"), "--device", "cpu", "--threads", str(threads),
                    "--region", REGION, *serve_args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log = []
        for line in self.proc.stdout:
            self.log.append(line)
            m = re.search(r'"event":"listening".*"port":(\d+)', line)
            if m:
                self.port = int(m.group(1))
                break
        else:
            self.stop()
            raise RuntimeError("rlloop serve exited before listening:\n" + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def k_values(candidates, max_k):
    ks = [k for k in candidates if k <= max_k]
    return ks if max_k in ks else ks + [max_k]


def machine_line():
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True,
                               cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except OSError:
        commit = "?"
    load = os.getloadavg()[0]
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, {platform.node()}, "
            f"{os.cpu_count()} cores, load average {load:.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--model", default=None, help="catalogue model (default rlloop-100m; rlloop-tiny with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: rlloop-tiny, 16 new tokens, forwardBackward of 4 x 16 tokens")
    parser.add_argument("--max-k", type=int, default=8, help="most sessions (K = 1, 2, 4, ... up to it)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="rlloop serve --threads")
    parser.add_argument("--sample-tokens", type=int, default=None, help="new tokens per sample (default 64)")
    parser.add_argument("--samples", type=int, default=2, help="samples per session's request (default 2)")
    parser.add_argument("--train-steps", type=int, default=2, help="forwardBackward operations per session")
    parser.add_argument("--train-rows", type=int, default=None, help="sequences per forwardBackward (default 8)")
    parser.add_argument("--train-tokens", type=int, default=None, help="tokens per sequence (default 64)")
    parser.add_argument("--train-k", type=int, nargs="+", default=[1, 4, 8], help="training session counts")
    parser.add_argument("--train-rounds", type=int, default=1,
                        help="repeat the training rounds; each K is compared with K=1 of its own round and the "
                             "summary takes the median, so load that changes during the run weighs less")
    args, serve_args = parser.parse_known_args()  # the rest, after --, goes to `rlloop serve`
    serve_args = [a for a in serve_args if a != "--"]
    quick = args.quick
    model = args.model or ("rlloop-tiny" if quick else "rlloop-100m")
    new_tokens = args.sample_tokens or (16 if quick else 64)
    rows = args.train_rows or (4 if quick else 8)
    length = args.train_tokens or (16 if quick else 64)
    sample_ks = k_values([1, 2, 4, 8, 16, 32], args.max_k)
    train_ks = sorted({k for k in args.train_k if k <= args.max_k} | {1})
    one_batch = args.samples * args.max_k  # the same rows as K=max sessions ask for, in one request

    print("```")
    print("$ " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable), *sys.argv]))
    print(machine_line())
    print("```")
    wall0 = time.monotonic()
    server = Server(args.binary, args.threads, serve_args, max_sessions=args.max_k)
    shown = [os.path.basename(server.cmd[0])] + [a.replace(server.dir, "$TMP") for a in server.cmd[1:]]
    print(f"\n`{' '.join(shown)}`; {model}, "
          f"LoRA rank {args.rank}; prompt {len(PROMPT)} tokens\n", flush=True)
    sessions, memory, sampling = [], {}, {}
    try:
        # ---- points 1 and 2: memory and sampling as sessions are added ----------------------------------------
        print(f"| sessions K | server resident memory | ... after the round | aggregate sampling tokens/s "
              f"({args.samples} x {new_tokens} per session) | vs K=1 | each session's wait (min-max) |")
        print("|---|---|---|---|---|---|")
        for k in sample_ks:
            fresh = [Session(server.port, f"tenant-{i}") for i in range(len(sessions), k)]

            def warm(s):  # created through the API, then one small operation so its model is really loaded
                t0 = time.monotonic()
                s.create(model, args.rank)
                s.sampled_tokens(s.submit_sample(1, 1, 1))
                return t0, 1

            together(fresh, warm)
            sessions += fresh
            time.sleep(0.5)
            memory[k] = rss_mib(server.proc.pid)

            def sample(s):
                t0 = time.monotonic()
                path = s.submit_sample(args.samples, new_tokens, 1000 + int(s.name.split("-")[1]))
                return t0, s.sampled_tokens(path)

            tokens, wall, waits = together(sessions[:k], sample)
            sampling[k] = tokens / wall
            after = rss_mib(server.proc.pid)
            print(f"| {k} | {memory[k]:,.0f} MiB | {after:,.0f} MiB | {sampling[k]:.1f} ({tokens} tokens in "
                  f"{wall:.2f} s) | {sampling[k] / sampling[sample_ks[0]]:.2f}x | "
                  f"{min(waits):.2f}-{max(waits):.2f} s |", flush=True)

        def batch(s):
            t0 = time.monotonic()
            return t0, s.sampled_tokens(s.submit_sample(one_batch, new_tokens, 999))

        tokens, wall, _ = together(sessions[:1], batch)
        sampling["batch"] = tokens / wall
        print(f"| 1 session asking for all {one_batch} rows in one request | — | {rss_mib(server.proc.pid):,.0f} MiB "
              f"| {sampling['batch']:.1f} "
              f"({tokens} tokens in {wall:.2f} s) | {sampling['batch'] / sampling[sample_ks[0]]:.2f}x | — |",
              flush=True)

        def many(s):  # a GRPO step's pattern: one session, a request per prompt, all submitted before any result
            t0 = time.monotonic()
            paths = [s.submit_sample(args.samples, new_tokens, 2000 + i) for i in range(args.max_k)]
            return t0, sum(s.sampled_tokens(p) for p in paths)

        tokens, wall, _ = together(sessions[:1], many)
        sampling["one session"] = tokens / wall
        print(f"| 1 session with {args.max_k} requests of {args.samples} x {new_tokens} at once | — | "
              f"{rss_mib(server.proc.pid):,.0f} MiB | {sampling['one session']:.1f} ({tokens} tokens in {wall:.2f} s) "
              f"| {sampling['one session'] / sampling[sample_ks[0]]:.2f}x | — |", flush=True)

        # ---- point 3: training under contention ----------------------------------------------------------------
        for s in sessions:  # warm-up, one session at a time: a small forwardBackward each
            path, n = s.submit_forward_backward(1, min(16, length))
            s.trained_tokens(path, n)
        ratios = {k: [] for k in train_ks[1:]}
        training = {}
        print(f"\n| round | training sessions K | aggregate training tokens/s ({args.train_steps} forwardBackward of "
              f"{rows} x {length} per session) | vs one session alone | each session's wait (min-max) |")
        print("|---|---|---|---|---|")
        for round_ in range(1, args.train_rounds + 1):
            for k in train_ks:
                def train(s):
                    t0 = time.monotonic()
                    ops = [s.submit_forward_backward(rows, length) for _ in range(args.train_steps)]
                    return t0, sum(s.trained_tokens(path, n) for path, n in ops)

                tokens, wall, waits = together(sessions[:k], train)
                training[k] = tokens / wall
                if k != 1:
                    ratios[k].append(training[k] / training[1])
                print(f"| {round_} | {k} | {training[k]:.1f} ({tokens:,} tokens in {wall:.2f} s) | "
                      f"{training[k] / training[1]:.2f}x | {min(waits):.2f}-{max(waits):.2f} s |", flush=True)
        memory["end"] = rss_mib(server.proc.pid)

        # ---- summary --------------------------------------------------------------------------------------------
        kmax = sample_ks[-1]
        mem_ratio = memory[kmax] / memory[1]
        batch_ratio = sampling[kmax] / sampling["batch"]
        worst = min(sample_ks[1:], key=lambda k: sampling[k], default=1)
        print("\n| point | figure | target | met |")
        print("|---|---|---|---|")
        print(f"| 1. memory, {kmax} sessions / 1 | {memory[kmax]:,.0f} / {memory[1]:,.0f} MiB = **{mem_ratio:.2f}x** "
              f"| <= 1.25x | {'yes' if mem_ratio <= 1.25 else 'no'} |")
        print(f"| 2. sampling, {kmax} sessions / 1 session with {one_batch} rows | {sampling[kmax]:.1f} / "
              f"{sampling['batch']:.1f} tokens/s = **{batch_ratio:.2f}x** | >= 0.75x | "
              f"{'yes' if batch_ratio >= 0.75 else 'no'} |")
        one = sampling["one session"] / sampling[kmax]
        print(f"| sampling, 1 session's {kmax} requests at once / {kmax} sessions' | {sampling['one session']:.1f} / "
              f"{sampling[kmax]:.1f} tokens/s = **{one:.2f}x** | (a session's requests batch as sessions' do) | — |")
        if len(sample_ks) > 1:
            low = sampling[worst] / sampling[1]
            print(f"| 2. sampling, lowest K > 1 (K={worst}) / K=1 | {sampling[worst]:.1f} / {sampling[1]:.1f} "
                  f"tokens/s = **{low:.2f}x** | >= 1.0x at every K | {'yes' if low >= 1.0 else 'no'} |")
        for k in train_ks[1:]:
            r = statistics.median(ratios[k])
            rounds = f"median of {len(ratios[k])} rounds" if len(ratios[k]) > 1 else "last round"
            print(f"| 3. training, {k} sessions / 1 ({rounds}) | **{r:.2f}x** | >= 0.9x | {'yes' if r >= 0.9 else 'no'} |")
        engine = [line.strip() for line in server.log if '"event":"engine"' in line]
        if engine:  # a server that logs its batching (rlloop serve --stats-interval-s): the last such line
            print(f"\nLast engine line the server logged (every --stats-interval-s while it changes): `{engine[-1]}`")
        print(f"\nResident memory at the end (after training): {memory['end']:,.0f} MiB; "
              f"whole run {time.monotonic() - wall0:.0f} s; load average now {os.getloadavg()[0]:.1f}.")
    except Exception:
        print("".join(server.log[-20:]), file=sys.stderr)
        raise
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
