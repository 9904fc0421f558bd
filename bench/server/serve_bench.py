"""Shared by bench/server/connections.py, bench/server/operations.py and tests/server/soak_test.py: an `rlloop serve`
child process (one bearer-key tenant, a temporary data dir, port 0), its Threads / VmRSS / VmSize and open file
descriptors from /proc, a minimal HTTP/1.1 client on a raw socket (keep-alive and pipelining: several requests sent
at once, the responses read in order) and the small training operations the benches run on one rlloop-tiny session.
Loopback only, standard library only.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

KEY = "bench-key"
SESSION = "bench"


# --- the server process ---------------------------------------------------------------------------------------------

def status(pid):
    """(Threads, VmRSS in MiB, VmSize in GiB) of process pid, from /proc/PID/status."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    kib = lambda k: int(fields[k].split()[0])
    return int(fields["Threads"]), kib("VmRSS") / 1024, kib("VmSize") / 1024 / 1024


def sockets(pid):
    """How many sockets process pid holds open (its listening socket, its connections)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def settle(pid, seconds=5.0, probe=None):
    """Waits until probe(pid) (default: the thread count) stops changing, for at most `seconds` (a server may take
    a moment to see its clients leave); returns status(pid)."""
    probe = probe or (lambda p: status(p)[0])
    last, deadline = None, time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = probe(pid)
        if now == last:
            break
        last = now
        time.sleep(0.25)
    return status(pid)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def new_root(prefix="rlloop-bench-", parent=None):
    """A temporary directory (under parent, default the system's) with tenants.json: one tenant, bearer key KEY,
    at most one session."""
    root = tempfile.mkdtemp(prefix=prefix, dir=parent)
    with open(os.path.join(root, "tenants.json"), "w") as f:
        json.dump({"tenants": [{"id": "bench", "bearerKeys": [KEY], "maxSessions": 1}]}, f)
    return root


class Server:
    """`rlloop serve --port 0 --threads 1 [--device DEVICE]` on root's tenants.json and root/data."""

    def __init__(self, binary, root, serve_args=(), device="cpu"):
        self.cmd = [binary, "serve", "--port", "0", "--threads", "1",
                    *(["--device", device] if device else []),
                    "--tenants", os.path.join(root, "tenants.json"), "--data-dir", os.path.join(root, "data"),
                    *serve_args]
        self.root = root
        self.data = os.path.join(root, "data")
        self.proc = None
        self.port = None

    @property
    def pid(self):
        return self.proc.pid

    def start(self, timeout=120):
        """Starts the server (its log appended to root/serve.log); returns (port, seconds from exec to its
        listening line)."""
        log_path = os.path.join(self.root, "serve.log")
        with open(log_path, "a") as log:
            seen = log.tell()
            t0 = time.monotonic()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            with open(log_path) as log:
                log.seek(seen)
                for line in log:
                    if '"event":"listening"' in line and line.endswith("\n"):
                        self.port = json.loads(line)["port"]
                        return self.port, time.monotonic() - t0
            if self.proc.poll() is not None:
                break
            time.sleep(0.005)
        self.kill()
        raise RuntimeError("the server did not start listening; its log:\n" + open(log_path).read()[-4000:])

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()


def remove(root):
    shutil.rmtree(root, ignore_errors=True)


# --- HTTP on a raw socket ---------------------------------------------------------------------------------------------

def http_request(method, path, body=None, target=None, keep_alive=True):
    """One request's bytes, authorized with KEY; body (a JSON value) as JSON, or as SageMaker's x-amz-json-1.1 with
    an X-Amz-Target of SageMaker.<target>."""
    data = b"" if body is None else json.dumps(body).encode()
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}"]
    if target:
        head += [f"X-Amz-Target: SageMaker.{target}", "Content-Type: application/x-amz-json-1.1"]
    elif body is not None:
        head.append("Content-Type: application/json")
    if body is not None or method == "POST":
        head.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


class Conn:
    """One client connection to 127.0.0.1:port. send() writes any number of requests at once (pipelining);
    response() reads the next response in order."""

    def __init__(self, port, timeout=120):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, *requests):
        self.sock.sendall(b"".join(requests))

    def _fill(self):
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def response(self):
        """(status code, body bytes) of the next response (Content-Length framed, as rlloop serve's JSON is)."""
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        code = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(b":") for l in lines[1:])}
        if b"content-length" not in headers:
            raise RuntimeError(f"response without Content-Length: {head[:300]!r}")
        length = int(headers[b"content-length"])
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return code, body

    def call(self, method, path, body=None, target=None):
        """One request on this (kept-alive) connection; its JSON response, which must be a 200."""
        self.send(http_request(method, path, body, target))
        code, data = self.response()
        if code != 200:
            raise RuntimeError(f"{method} {path}: {code} {data[:300]!r}")
        return json.loads(data)

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def usage_once(port, keep_alive):
    """GET /v1/usage on a new connection, which must answer 200; returns the connection, open when keep_alive, else
    closed once the server closed its side (as Connection: close asks)."""
    conn = Conn(port)
    try:
        conn.send(http_request("GET", "/v1/usage", keep_alive=keep_alive))
        code, data = conn.response()
        if code != 200:
            raise RuntimeError(f"GET /v1/usage: {code} {data[:300]!r}")
        if not keep_alive:
            try:
                conn._fill()
                raise RuntimeError(f"GET /v1/usage with Connection: close: more after the response {conn.buf[:300]!r}")
            except ConnectionError:  # the server's end of the stream: what was expected
                pass
            conn.close()
    except BaseException:
        conn.close()
        raise
    return conn


# --- training operations ----------------------------------------------------------------------------------------------

def datum(seq, i, tokens=64):
    ids = [(seq * 7 + i * 13 + k) % 250 + 1 for k in range(tokens + 1)]
    return {
        "modelInput": {"chunks": [{"type": "encoded_text", "tokens": ids[:-1]}]},
        "lossFnInputs": {
            "target_tokens": {"data": ids[1:], "dtype": "int64", "shape": [tokens]},
            "weights": {"data": [1.0] * tokens, "dtype": "float32", "shape": [tokens]},
        },
    }


def operation_request(seq, rows=4, tokens=64, steps=True):
    """The body of training operation seq (with clientToken bench-<seq>): forwardBackward of `rows` sequences of
    `tokens` tokens when seq is odd (or steps=False), optimizerStep when even."""
    if seq % 2 or not steps:
        config = {"forwardBackward": {"datumList": [datum(seq, i, tokens) for i in range(rows)],
                                      "lossFnName": "cross_entropy"}}
    else:
        config = {"optimizerStep": {"adamParamsConfig": {"learningRate": 1e-4}}}
    return {"sequenceNumber": seq, "clientToken": f"bench-{seq}", "operationConfig": config}


OPERATIONS = f"/v1/training-sessions/{SESSION}/operations"


class Client(Conn):
    """A keep-alive connection driving the session SESSION."""

    def create_session(self, rank=4, model="rlloop-tiny"):
        self.call("POST", "/", {
            "TrainingSessionName": SESSION, "RoleArn": "arn:aws:iam::000000000000:role/Bench",
            "LoraConfig": {"Rank": rank, "Alpha": 2 * rank}, "ModelConfig": {"BaseModelArn": model},
            "OutputConfig": {"S3Location": {"Path": "s3://bench/out/"}}}, target="CreateTrainingSession")
        while self.call("POST", "/", {"TrainingSessionName": SESSION}, target="DescribeTrainingSession")[
                "TrainingSessionDetail"]["TrainingSessionStatus"] != "Running":
            time.sleep(0.05)

    def operations(self, first, count, rows=4, tokens=64, steps=True):
        """Runs training operations first .. first+count-1: their submissions pipelined on this connection, then
        their results fetched (long-poll, also pipelined), each of which must be Completed. count=1: one at a time."""
        ids = []
        self.send(*(http_request("POST", OPERATIONS, operation_request(seq, rows, tokens, steps))
                    for seq in range(first, first + count)))
        for seq in range(first, first + count):
            code, data = self.response()
            if code != 200:
                raise RuntimeError(f"operation {seq}: submission answered {code} {data[:300]!r}")
            ids.append(json.loads(data)["operationId"])
        pending = list(zip(range(first, first + count), ids))
        while pending:  # a long-poll may end before its operation does: ask again for those
            self.send(*(http_request("GET", f"{OPERATIONS}/{op}?waitSeconds=20") for _, op in pending))
            still = []
            for seq, op in pending:
                code, data = self.response()
                if code != 200:
                    raise RuntimeError(f"operation {seq}: result answered {code} {data[:300]!r}")
                result = json.loads(data)
                if result["status"] in ("Pending", "InProgress"):
                    still.append((seq, op))
                elif result["status"] != "Completed":
                    raise RuntimeError(f"operation {seq}: {result}")
            pending = still

    def operation(self, seq, rows=4, tokens=64, steps=True):
        self.operations(seq, 1, rows, tokens, steps)
