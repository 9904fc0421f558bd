"""rlloop's C++ remote session against AWS's service models: every request that remote_calls.cpp (each call of
RemoteSession once, SigV4-signed, with inputs the models allow) sends passes through a recording proxy on its way
to `rlloop serve`, and each one must match an operation of the two models (method, URI, X-Amz-Target) and
validate against its input shape (service_models.validate, strict: types, required, bounds, patterns, enums, no
unknown members). Beyond the models the client may only use what docs/wire.md lists as its extensions: the
routes in EXTENSION_ROUTES, and the headers and query parameters below.

Usage: python remote_requests_test.py <rlloop binary> <remote_calls binary>
"""

import http.client
import http.server
import json
import os
import re
import subprocess
import sys
import threading

import rlloop_serve
import service_models

# rlloop serve's own routes that RemoteSession reads (docs/wire.md, "Extensions"): GET only.
EXTENSION_ROUTES = [r"/v1/training-sessions/[^/]+/info", r"/v1/base-models", r"/v1/capabilities"]
EXTENSION_HEADERS = {"idempotency-key"}
EXTENSION_QUERY = {"waitSeconds"}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream = None  # (host, port)
    requests = []

    def log_message(self, *args):
        pass

    def _relay(self):
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length) if length else b""
        Recorder.requests.append((self.command, self.path, dict(self.headers.items()), body))
        conn = http.client.HTTPConnection(*Recorder.upstream, timeout=120)
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for k, v in self.headers.items():  # verbatim, Host included: the SigV4 signature covers them
            if k.lower() not in HOP_BY_HOP:
                conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_GET = do_POST = do_DELETE = _relay


def runtime_operation(model, method, path):
    """The runtime operation whose method and URI template match, with its URI labels, or (None, None)."""
    for name in model.operation_names:
        op = model.operation_model(name)
        if op.http["method"] != method:
            continue
        template = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", op.http["requestUri"])
        m = re.fullmatch(template, path)
        if m:
            return op, m.groupdict()
    return None, None


def check(requests, runtime, control):
    seen, problems = set(), []
    for method, target, headers, body in requests:
        path, _, query = target.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if p)
        lower = {k.lower(): v for k, v in headers.items()}
        for k in set(lower) & EXTENSION_HEADERS:
            seen.add(f"header {k}")
        for k in params:
            if k not in EXTENSION_QUERY:
                problems.append(f"{method} {target}: query parameter {k} is neither modelled nor a documented extension")
            seen.add(f"query {k}")
        if "x-amz-target" in lower:
            name = lower["x-amz-target"].removeprefix("SageMaker.")
            if name not in service_models.CONTROL_OPERATIONS or method != "POST" or path != "/":
                problems.append(f"{method} {target} {name}: not a control-plane training-session operation")
                continue
            op = control.operation_model(name)
            if lower.get("content-type") != "application/x-amz-json-1.1":
                problems.append(f"{name}: Content-Type {lower.get('content-type')}, the model's JSON 1.1 wants application/x-amz-json-1.1")
            value = json.loads(body or b"{}")
        else:
            op, labels = runtime_operation(runtime, method, path)
            if op is None:
                if method == "GET" and any(re.fullmatch(r, path) for r in EXTENSION_ROUTES):
                    seen.add(f"route {path}")
                    continue
                problems.append(f"{method} {target}: matches no operation of the runtime model")
                continue
            value = dict(labels)
            if body:
                value.update(json.loads(body))
        seen.add(op.name)
        try:
            service_models.validate(op.input_shape, value, op.name)
        except service_models.Violation as e:
            problems.append(str(e))
    return seen, problems


def main():
    rlloop, remote_calls = sys.argv[1], sys.argv[2]
    runtime = service_models.load(service_models.RUNTIME)
    control = service_models.load(service_models.CONTROL)
    with rlloop_serve.Server(rlloop) as server:
        Recorder.upstream = ("127.0.0.1", server.port)
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        env = dict(os.environ, AWS_ACCESS_KEY_ID=rlloop_serve.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=rlloop_serve.SECRET_KEY)
        env.pop("RLLOOP_API_KEY", None)
        run = subprocess.run([remote_calls, f"http://127.0.0.1:{proxy.server_address[1]}"],
                             env=env, capture_output=True, text=True, timeout=300)
        proxy.shutdown()
    if run.returncode != 0:
        print(run.stdout, run.stderr, "".join(server.log[-20:]))
        sys.exit(f"remote_calls failed with status {run.returncode}")
    seen, problems = check(Recorder.requests, runtime, control)
    print(f"{len(Recorder.requests)} requests; operations and extensions used: {sorted(seen)}")
    for needed in ("CreateTrainingSession", "DescribeTrainingSession", "StopTrainingSession",
                   "ExecuteTrainingOperation", "GetTrainingOperationResult",
                   "ExecuteSamplingOperation", "GetSamplingOperationResult"):
        if needed not in seen:
            problems.append(f"remote_calls never sent {needed}: the check did not cover it")
    if problems:
        print("FAIL:\n  " + "\n  ".join(problems[:20]))
        sys.exit(1)
    print("every request validates against the service models' input shapes")


if __name__ == "__main__":
    main()
