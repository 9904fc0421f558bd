"""Starts `rlloop serve` for the Python tests: one tenant with a SigV4 access key, a fresh data directory, port 0
(the kernel picks a free port; the real one is read from the server's own {"event":"listening"} log line)."""

import json
import os
import re
import subprocess
import tempfile
import threading
import time

ACCESS_KEY = "AKIDRLLOOPTEST"
SECRET_KEY = "rlloop-test-secret"
ACCOUNT = "111122223333"
REGION = "us-west-2"
ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/rlloop-test"


def hub_model_arn(model):
    """The SageMaker Hub ARN of a catalogue model, the form BaseModelArn takes on the wire."""
    return f"arn:aws:sagemaker:{REGION}:aws:hub-content/SageMakerPublicHub/Model/{model}/1.0.0"


def write_tenants(directory, max_sessions=8, bearer_keys=None):
    """The tenants file of the tests in `directory`; its path."""
    bearer_keys = bearer_keys or {}
    tenants = {
        "tenants": [
            {
                "id": "aws",
                "accountId": ACCOUNT,
                "maxSessions": max_sessions,
                "accessKeys": [{"accessKeyId": ACCESS_KEY, "secretAccessKey": SECRET_KEY}],
                "bearerKeys": bearer_keys.get("aws", []),
            }
        ] + [{"id": tenant, "maxSessions": max_sessions, "bearerKeys": keys}
             for tenant, keys in bearer_keys.items() if tenant != "aws"]
    }
    path = os.path.join(directory, "tenants.json")
    with open(path, "w") as f:
        json.dump(tenants, f)
    return path


class Server:
    def __init__(self, rlloop, max_sessions=8, extra_args=(), bearer_keys=None, launcher=(), command="serve",
                 argv=None, env=None):
        """bearer_keys: {tenant id: [keys]} (Tinker's X-API-Key too); tenant "aws" is the one with the access key,
        any other id is a tenant of its own. launcher: a command line put before rlloop's (torchrun ...); argv:
        instead of rlloop's, any command line that starts the server (with `env`). A server started through a
        launcher or `argv` runs in a process group of its own, stopped whole."""
        self.dir = tempfile.mkdtemp(prefix="rlloop-aws-")
        self.tenants = write_tenants(self.dir, max_sessions, bearer_keys)
        args = argv or [*launcher, rlloop, command, "--tenants", self.tenants, "--port", "0",
                        "--data-dir", os.path.join(self.dir, "data"), "--device", "cpu", "--threads", "1",
                        "--region", REGION, *extra_args]
        self.group = bool(launcher or argv)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=self.group)
        self.log = []
        listening = threading.Event()
        self.port = None

        def read():
            for line in self.proc.stdout:
                self.log.append(line)
                m = re.search(r'"event":"listening".*"port":(\d+)', line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    listening.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.time() + 60
        while not listening.wait(0.05):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("rlloop serve did not start:\n" + "".join(self.log))
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self):
        def signal(sig):
            if self.group:
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            else:
                self.proc.send_signal(sig)

        signal(15)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            signal(9)
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
