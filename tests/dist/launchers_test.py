#!/usr/bin/env python3
"""A data-parallel `rlloop serve` group started by the cluster's own launchers (docs/distributed.md).

  launchers_test.py RLLOOP    (the rlloop CLI; torchrun, the Tinker SDK and PyYAML from third_party/venv)

- torchrun (the pinned PyPI torch's) starts `rlloop worker` twice; the process with RANK=0 serves, the other works,
  both on torchrun's agent's store. Three LoRA steps through the Tinker SDK give the same losses, bit for bit, as
  `rlloop serve --world-size 2` with its own worker (the same split of the batch over two ranks); with `--shard full`
  (each rank holding half of the base) the same losses as `rlloop serve --world-size 2 --shard full`, bit for bit,
  and those of the replicated run within 1e-5 relative.
- The Slurm batch script in docs/distributed.md, run as written with `srun` and `scontrol` stand-ins that do what
  Slurm's do for two tasks on one node: the same losses again.
- The PyTorchJob manifest in docs/distributed.md parses: a PyTorchJob whose master and workers run one `rlloop
  worker` command, with flags `rlloop serve --help` lists.
Fails (never skips) when the venv or one of its packages is missing.
"""
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "aws"))
os.environ["TINKER_TELEMETRY"] = "0"
try:
    import tinker
    import yaml
    from tinker import types

    import rlloop_serve
except ImportError as e:
    sys.exit(f"launchers_test: {e}; scripts/setup.sh --tests installs the pinned packages into third_party/venv")

TORCHRUN = os.path.join(ROOT, "third_party", "venv", "bin", "torchrun")
DOC = os.path.join(ROOT, "docs", "distributed.md")
KEY = "tml-rlloop-launchers"
RLLOOP = None


def free_port():
    """A free port whose next one is free too: under LibTorch 1.13 rank 0 hosts the group's store on MASTER_PORT + 1
    (follow_launcher, src/cli/cmd_serve.cpp), and a port taken there by another test's connection failed a run."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as after:
                try:
                    after.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port with a free next port on 127.0.0.1")


def doc_block(language):
    """The first fenced block of `language` in docs/distributed.md."""
    with open(DOC) as f:
        text = f.read()
    m = re.search(r"```" + language + r"\n(.*?)```", text, re.S)
    if not m:
        raise AssertionError(f"docs/distributed.md has no ```{language} block")
    return m.group(1)


def three_steps(endpoint):
    """loss:sum of three cross-entropy steps of a LoRA adapter (seeded) on rlloop-small, each followed by Adam."""
    service = tinker.ServiceClient(base_url=endpoint, api_key=KEY)
    training = service.create_lora_training_client("rlloop-small", rank=8, seed=11).result()
    data = []
    for i in range(4):
        tokens = [(7 * i + 3 * j) % 200 + 1 for j in range(6 + i)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}))
    losses = []
    for _ in range(3):
        out = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(out.metrics["loss:sum"])
    return losses


class Launchers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with rlloop_serve.Server(RLLOOP, extra_args=("--world-size", "2"),
                                 bearer_keys={"aws": [KEY]}) as server:
            cls.expected = three_steps(server.endpoint)
        print(f"rlloop serve --world-size 2: losses {cls.expected}", file=sys.stderr)

    def test_torchrun_starts_one_command_on_every_rank(self):
        launcher = (TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                    str(free_port()), "--no-python")
        with rlloop_serve.Server(RLLOOP, launcher=launcher, command="worker", bearer_keys={"aws": [KEY]}) as server:
            losses = three_steps(server.endpoint)
            log = "".join(server.log)
        self.assertEqual(losses, self.expected)
        self.assertIn('"event":"worker","launcher":"torchrun","rank":1', log)

    def test_torchrun_reproduces_a_fully_sharded_run(self):
        sharded = ("--shard", "full")
        with rlloop_serve.Server(RLLOOP, extra_args=("--world-size", "2", *sharded),
                                 bearer_keys={"aws": [KEY]}) as server:
            expected = three_steps(server.endpoint)
        launcher = (TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                    str(free_port()), "--no-python")
        with rlloop_serve.Server(RLLOOP, launcher=launcher, command="worker", extra_args=sharded,
                                 bearer_keys={"aws": [KEY]}) as server:
            losses = three_steps(server.endpoint)
            log = "".join(server.log)
        print(f"--shard full: losses {expected} (torchrun: {losses})", file=sys.stderr)
        self.assertEqual(losses, expected)
        self.assertIn('"event":"worker","launcher":"torchrun","rank":1,"rendezvous"', log)
        self.assertIn('"shard":"full"}', log)
        for got, replicated in zip(expected, self.expected):
            self.assertAlmostEqual(got, replicated, delta=1e-5 * abs(replicated))

    def test_the_slurm_script_runs_as_written(self):
        bin_dir = tempfile.mkdtemp(prefix="rlloop-slurm-")
        stand_ins = {
            # One task per SLURM_NTASKS on this node, as srun starts them, each told its place.
            "srun": '#!/bin/bash\nfor ((i = 0; i < SLURM_NTASKS; i++)); do\n'
                    '  SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &\ndone\nwait\n',
            "scontrol": '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && echo localhost\n',
        }
        for name, text in stand_ins.items():
            path = os.path.join(bin_dir, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        script = os.path.join(bin_dir, "rlloop.sbatch")
        with open(script, "w") as f:
            f.write(doc_block("bash"))
        data = tempfile.mkdtemp(prefix="rlloop-slurm-data-")
        tenants = rlloop_serve.write_tenants(data, bearer_keys={"aws": [KEY]})
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], SLURM_NTASKS="2",
                   SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(free_port()),
                   RLLOOP=RLLOOP, TENANTS=tenants, PORT="0", DATA_DIR=os.path.join(data, "server"),
                   RLLOOP_FLAGS="--device cpu --threads 1")
        try:
            with rlloop_serve.Server(RLLOOP, argv=["bash", script], env=env) as server:
                losses = three_steps(server.endpoint)
                log = "".join(server.log)
        finally:
            shutil.rmtree(bin_dir, ignore_errors=True)
        self.assertEqual(losses, self.expected)
        self.assertIn('"event":"worker","launcher":"slurm","rank":1', log)

    def test_the_pytorchjob_manifest_runs_one_rlloop_command(self):
        job = yaml.safe_load(doc_block("yaml"))
        self.assertEqual((job["apiVersion"], job["kind"]), ("kubeflow.org/v1", "PyTorchJob"))
        replicas = job["spec"]["pytorchReplicaSpecs"]
        self.assertEqual(sorted(replicas), ["Master", "Worker"])
        self.assertEqual(replicas["Master"]["replicas"], 1)
        self.assertGreaterEqual(replicas["Worker"]["replicas"], 1)
        commands = []
        for role in ("Master", "Worker"):
            container = replicas[role]["template"]["spec"]["containers"][0]
            self.assertEqual(container["name"], "pytorch")  # the training operator sets its env in this one
            commands.append(container["command"])
        self.assertEqual(commands[0], commands[1])
        self.assertEqual(commands[0][:2], ["rlloop", "worker"])
        serve_help = rlloop_serve.subprocess.run([RLLOOP, "serve", "--help"], capture_output=True, text=True).stdout
        for flag in (a for a in commands[0][2:] if a.startswith("--")):
            self.assertRegex(serve_help, r"\s" + re.escape(flag) + r"\b", flag)


if __name__ == "__main__":
    RLLOOP = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
