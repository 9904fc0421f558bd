#!/usr/bin/env python3
"""The same Tinker loop through tinker 0.12.0, the protocol's JSON generation (the one skyrl-tx serves).

  tinker012_test.py RLLOOP TINKER_0_12_DIR   (the rlloop CLI; the directory `pip install --target` filled with
                                             tinker 0.12.0 alone: scripts/setup.sh --tests; the rest of its
                                             dependencies are third_party/venv's)

tinker 0.12 asks for no client/config, sends forward_backward and forward as JSON (loss inputs as
{"data", "dtype", "shape"}) and reads every result as JSON (it sends no `Accept: application/x-protobuf`). Against
`rlloop serve` on the built-in rlloop-small with LoRA, unchanged:
  - forward with cross_entropy: loss:sum equals the formula over the logprobs it returned, and those equal
    compute_logprobs' prompt logprobs of the same tokens on a sampler of the same weights (JSON SampleResponse);
  - importance_sampling through forward_backward, then optim_step: the cross-entropy loss falls over three steps;
  - sample: num_samples sequences with one logprob per token;
  - save_state and a sampler from named weights (tinker:// paths);
  - bad input (an unknown loss, a token id out of the vocabulary; below the SDK, a float64 loss input and a [T, K]
    one) is refused with the message naming the field, and the model keeps working.
Fails (never skips) when the venv or tinker 0.12 is missing.
"""
import os
import sys
import unittest

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "aws"))
os.environ["TINKER_TELEMETRY"] = "0"
if len(sys.argv) != 3:
    sys.exit(__doc__)
RLLOOP, TINKER_DIR = sys.argv[1], sys.argv[2]
sys.path.insert(0, TINKER_DIR)
try:
    import httpx
    import tinker
    from tinker import types

    import rlloop_serve
except ImportError as e:
    sys.exit(f"tinker012_test: {e}; scripts/setup.sh --tests installs tinker 0.12.0 into {TINKER_DIR}")
if tinker.__version__ != "0.12.0":
    sys.exit(f"tinker012_test: {TINKER_DIR} holds tinker {tinker.__version__}, not 0.12.0")

KEY = "tml-rlloop-test"
BASE = "rlloop-small"
SERVER = None


def datum(tokens, **inputs):
    """A next-token datum over `tokens`: input tokens[:-1], targets tokens[1:], weight 1 each."""
    n = len(tokens) - 1
    loss_inputs = {"target_tokens": tokens[1:], "weights": [1.0] * n}
    loss_inputs.update(inputs)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_inputs)


def logprobs_of(output):
    return [list(o["logprobs"].data) for o in output.loss_fn_outputs]


class Tinker012Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.service = tinker.ServiceClient(base_url=SERVER.endpoint, api_key=KEY)
        # 0.12's clients are made synchronously (0.38's return futures).
        cls.training = cls.service.create_lora_training_client(BASE, rank=8)
        cls.data = [datum([5, 17, 42, 7, 99, 3]), datum([8, 8, 13, 21, 34])]

    def test_forward_matches_its_formula_and_compute_logprobs(self):
        out = self.training.forward(self.data, "cross_entropy").result()
        lps = logprobs_of(out)
        self.assertEqual([len(row) for row in lps], [5, 4])
        self.assertAlmostEqual(out.metrics["loss:sum"], -sum(sum(row) for row in lps), places=3)
        sampler = self.training.save_weights_and_get_sampling_client()
        for d, row in zip(self.data, lps):
            tokens = d.model_input.to_ints() + [d.loss_fn_inputs["target_tokens"].data[-1]]
            prompt_lps = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
            self.assertIsNone(prompt_lps[0])
            for a, b in zip(prompt_lps[1:], row):
                self.assertAlmostEqual(a, b, places=4)

    def test_training_lowers_the_loss(self):
        training = self.service.create_lora_training_client(BASE, rank=8, seed=3)
        data = [datum([3, 1, 4, 1, 5, 9, 2, 6])]
        losses = []
        for _ in range(3):
            losses.append(training.forward(data, "cross_entropy").result().metrics["loss:sum"])
            advantages = {"advantages": [1.0] * 7, "logprobs": logprobs_of(training.forward(data, "cross_entropy")
                                                                             .result())[0]}
            training.forward_backward([datum([3, 1, 4, 1, 5, 9, 2, 6], **advantages)], "importance_sampling").result()
            training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        print(f"tinker 0.12 losses {losses}", file=sys.stderr)
        self.assertLess(losses[-1], losses[0])

    def test_sample_and_named_checkpoints(self):
        saved = self.training.save_state("ckpt012").result()
        self.assertTrue(saved.path.startswith("tinker://"), saved.path)
        weights = self.training.save_weights_for_sampler("sampler012").result()
        sampler = self.service.create_sampling_client(model_path=weights.path)
        result = sampler.sample(types.ModelInput.from_ints([5, 17, 42]), 3,
                                types.SamplingParams(max_tokens=6, seed=7)).result()
        self.assertEqual(len(result.sequences), 3)
        for seq in result.sequences:
            self.assertGreater(len(seq.tokens), 0)
            self.assertEqual(len(seq.logprobs), len(seq.tokens))
            self.assertIn(seq.stop_reason, ("length", "stop"))

    def test_bad_input_is_refused_by_name_and_the_model_goes_on(self):
        with self.assertRaises(Exception) as unknown:
            self.training.forward_backward(self.data, "no_such_loss").result()
        self.assertIn("no_such_loss", str(unknown.exception))
        with self.assertRaises(Exception) as out_of_range:
            self.training.forward([datum([5, 17, 10_000_000])], "cross_entropy").result()
        self.assertIn("10000000", str(out_of_range.exception))
        # Below the SDK: a loss input of another dtype, and one of two values per token, each named.
        model_id = self.training._guaranteed_model_id()
        for tensor, message in (({"data": [2.0, 3.0], "dtype": "float64"}, "must be float32 or int64, got float64"),
                                ({"data": [2, 3, 4, 5], "dtype": "int64", "shape": [2, 2]},
                                 "rlloop's losses take no [T, K] inputs")):
            body = {"forward_backward_input": {"data": [{"model_input": {"chunks": [{"tokens": [1, 2]}]},
                                                         "loss_fn_inputs": {"target_tokens": tensor}}],
                                               "loss_fn": "cross_entropy"},
                    "model_id": model_id, "seq_id": 10_000}
            answer = httpx.post(f"{SERVER.endpoint}/api/v1/forward_backward", json=body,
                                headers={"X-API-Key": KEY}, timeout=60)
            self.assertEqual(answer.status_code, 400, answer.text)
            self.assertIn("data[0].loss_fn_inputs.target_tokens", answer.json()["error"])
            self.assertIn(message, answer.json()["error"])
        out = self.training.forward(self.data, "cross_entropy").result()
        self.assertGreater(out.metrics["loss:sum"], 0)


def main():
    global SERVER
    with rlloop_serve.Server(RLLOOP, max_sessions=16, bearer_keys={"aws": [KEY]}) as server:
        SERVER = server
        result = unittest.main(argv=[sys.argv[0], "-v"], exit=False).result
        if not result.wasSuccessful():
            print("".join(server.log[-40:]))
        return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
