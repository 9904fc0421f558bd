"""The SageMaker Python SDK's training-session clients (sagemaker-train, sagemaker.train.training_session:
ServiceClient -> TrainingClient -> SamplingClient) against `rlloop serve`, unmodified, with only the endpoint and
the credentials changed: a shorter run of examples/sagemaker_sdk/sft_grpo.py (SFT, then GRPO, on single-digit
addition with rlloop-small + LoRA), checking what it measures: the SFT loss falls, sampled sequences end with
stopReason stop or length and carry one logprob per token, a client from save_weights_and_get_sampling_client
samples the weights it saved (and keeps doing so after training moves on), and GRPO raises the reward. The same
loop, shortened, runs on the built-in mixture of experts (rlloop-tiny-moe) as a smoke test.

Usage: python sagemaker_sdk_test.py [<rlloop binary>]      (third_party/venv's Python; default build/bin/rlloop)
"""

import math
import os
import re
import statistics
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "examples", "sagemaker_sdk"))
sys.path.insert(0, HERE)

import rlloop_serve  # noqa: E402
import sft_grpo as demo  # noqa: E402

RLLOOP = None
SFT_STEPS, GRPO_STEPS, SEED = 200, 20, 1


class DemoServerTestCase(unittest.TestCase):
    """A test class with the demo's `rlloop serve` (cls.server) and an SDK service client on it (cls.svc), started
    once for the class; prints how long the class took."""

    SERVE_ARGS = ()  # more `rlloop serve` flags

    @classmethod
    def setUpClass(cls):
        cls.t0 = time.time()
        cls.server = demo.start_server(RLLOOP, extra_args=cls.SERVE_ARGS)
        demo.configure_environment(cls.server.endpoint, rlloop_serve.ACCESS_KEY, rlloop_serve.SECRET_KEY)
        cls.svc = demo.service_client(rlloop_serve.ACCOUNT, rlloop_serve.ROLE_ARN)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        print(f"\n{cls.__name__}: {time.time() - cls.t0:.0f} s", file=sys.stderr)


class SdkSftThenGrpo(DemoServerTestCase):

    def assert_sequences(self, sequences, n):
        self.assertEqual(len(sequences), n)
        for s in sequences:
            self.assertIn(s.stop_reason.value, ("stop", "length"))
            self.assertTrue(all(0 <= t < 260 for t in s.tokens), s.tokens)
            self.assertIsNotNone(s.logprobs)
            self.assertEqual(len(s.logprobs), len(s.tokens))
            self.assertTrue(all(lp <= 0.0 for lp in s.logprobs), s.logprobs)

    def test_sft_then_grpo(self):
        o = demo.GrpoOptions()
        train_set = demo.ArithmeticTask().all_problems(demo.TRAIN)
        held_out = demo.ArithmeticTask().all_problems(demo.HELD_OUT)
        self.assertEqual(len(train_set) + len(held_out), 100)
        self.assertFalse({p.prompt for p in train_set} & {p.prompt for p in held_out})
        # A fixed completion scored by every model below: prompt + "#### 5" + end-of-text.
        probe = demo.encode("2+3=") + demo.encode("#### 5") + [demo.EOS]

        with self.svc.create_lora_training_client(demo.hub_model_arn("rlloop-small"), rank=32, alpha=64) as tc:
            name = tc.training_session_name
            self.assertTrue(name.startswith("sagemaker-training-session-"), name)

            # The base model (modelPackageArn omitted): random weights, no answer format.
            base = tc.create_sampling_client()
            seqs = base.sample(demo.encode("2+3="), 2, demo.sampling_params(1.0, seed=3)).result().sequences
            self.assert_sequences(seqs, 2)
            base_lp = base.compute_logprobs(probe).result()
            self.assertEqual(len(base_lp), len(probe))
            self.assertIsNone(base_lp[0])  # the SDK's List[Optional[float]]: the first token has no context
            self.assertTrue(all(isinstance(x, float) and x < 0 for x in base_lp[1:]), base_lp)

            # SFT: the loss per completion token falls from about ln(260) = 5.56.
            losses = demo.sft(tc, demo.ArithmeticTask(seed=SEED), SFT_STEPS, 32, 1e-3, log=None)
            self.assertGreater(losses[0], 5.0, losses[:5])
            self.assertLess(statistics.mean(losses[-10:]), 3.6, losses[-10:])
            self.assertLess(statistics.mean(losses[-10:]), statistics.mean(losses[:10]) - 1.0)

            sft_sc = tc.save_weights_and_get_sampling_client()
            self.assertRegex(sft_sc.model_package_arn,
                             rf"^arn:aws:sagemaker:us-west-2:{rlloop_serve.ACCOUNT}:model-package/{re.escape(name)}/\d+$")

            # The new client samples the saved weights: its logprobs of the probe are the training model's at save
            # time (forward on the session), not the base model's, ...
            sft_lp = sft_sc.compute_logprobs(probe).result()
            datum = demo.completion_datum(probe[:4], probe[4:])
            train_lp = tc.forward([datum], loss_fn="cross_entropy").result().loss_fn_outputs[0]["logprobs"]["data"]
            self.assertEqual(len(train_lp), len(probe) - 1)
            for a, b in zip(sft_lp[1:], train_lp):
                self.assertAlmostEqual(a, b, delta=2e-3)
            self.assertGreater(max(abs(a - b) for a, b in zip(sft_lp[1:], base_lp[1:])), 0.1)
            # ... and greedy answers are now in the trained format, ending at end-of-text.
            acc_sft, texts, stops = demo.evaluate(sft_sc, train_set)
            self.assertGreaterEqual(statistics.mean(bool(re.fullmatch(r"#### \d+", t)) for t in texts), 0.9, texts)
            self.assertGreaterEqual(stops.count("stop") / len(stops), 0.9, stops)
            self.assertGreater(acc_sft, 0.2)
            groups = demo.sample_all(sft_sc, train_set[:3], o.group_size, o.temperature, seed=11, top_k=o.top_k)
            for g in groups:
                self.assert_sequences(g, o.group_size)
            reward_sft = demo.sampled_reward(sft_sc, train_set, o)

            # GRPO from the SFT weights.
            final_sc, history = demo.grpo(tc, sft_sc, demo.ArithmeticTask(seed=SEED + 2000), GRPO_STEPS, o, SEED, log=None)
            self.assertEqual(len(history), GRPO_STEPS)
            self.assertTrue(all(h["datums"] > 0 and "loss" in h for h in history), history)
            for h in history:
                self.assertTrue(set(h["stop_reasons"]) <= {"stop", "length"}, h["stop_reasons"])
            self.assertNotEqual(final_sc.model_package_arn, sft_sc.model_package_arn)

            reward_final = demo.sampled_reward(final_sc, train_set, o)
            acc_final, _, _ = demo.evaluate(final_sc, train_set)
            acc_held_sft, acc_held_final = demo.evaluate(sft_sc, held_out)[0], demo.evaluate(final_sc, held_out)[0]
            print(f"\nSFT loss {losses[0]:.3f} -> {losses[-1]:.3f}; mean sampled reward {reward_sft:.3f} -> "
                  f"{reward_final:.3f}; greedy accuracy {acc_sft:.3f} -> {acc_final:.3f} (training problems), "
                  f"{acc_held_sft:.3f} -> {acc_held_final:.3f} (held-out)", file=sys.stderr)
            self.assertGreater(reward_final, reward_sft + 0.05)
            self.assertGreater(acc_final, acc_sft + 0.05)
            self.assertGreaterEqual(acc_held_final, acc_held_sft)

            # The SFT checkpoint is unchanged by the training after it: its client still serves the same weights.
            again = sft_sc.compute_logprobs(probe).result()
            for a, b in zip(again[1:], sft_lp[1:]):
                self.assertAlmostEqual(a, b, delta=1e-5)
            final_lp = final_sc.compute_logprobs(probe).result()
            self.assertGreater(max(abs(a - b) for a, b in zip(final_lp[1:], sft_lp[1:])), 1e-4)

        # Leaving the block, the SDK stops the session.
        [summary] = self.svc.list_sessions(name_contains=name)
        self.assertEqual(summary.training_session_name, name)
        self.assertIn(getattr(summary.status, "value", summary.status), ("Stopping", "Stopped"))


class SdkGrpoOnATinyMixtureOfExperts(DemoServerTestCase):
    """The demo's SFT-then-GRPO loop, shortened, on the built-in mixture of experts (rlloop-tiny-moe: qwen3_moe,
    8 experts, top 2) through the SDK: a smoke test that a model with experts takes the whole path (a LoRA session on
    attention, router and experts, forward_backward, optim_step, saved weights, sampling clients)."""

    def test_sft_then_grpo(self):
        out = demo.run(self.server.endpoint, rlloop_serve.ACCESS_KEY, rlloop_serve.SECRET_KEY, rlloop_serve.ACCOUNT,
                       rlloop_serve.ROLE_ARN, model="rlloop-tiny-moe", rank=8, alpha=16, sft_steps=40, sft_batch=16,
                       sft_lr=3e-3, grpo_steps=3, log=lambda *_: None)
        losses = out["sft_losses"]
        self.assertEqual(len(losses), 40)
        # Width 32 and a frozen random embedding leave a rank-8 adapter little to fit: measured 5.33 -> 5.11.
        self.assertLess(statistics.mean(losses[-5:]), statistics.mean(losses[:5]) - 0.1, losses)
        # The GRPO steps sample every group from the weights the step before saved; this model earns no reward (it
        # never writes "#### N"), so its groups carry no advantage and train nothing ...
        self.assertEqual(len(out["grpo"]), 3)
        for h in out["grpo"]:
            self.assertEqual(len(h["stop_reasons"]), 16 * 8)
            self.assertTrue(set(h["stop_reasons"]) <= {"stop", "length"}, h["stop_reasons"])
            self.assertEqual("loss" in h, h["datums"] > 0)
        self.assertNotEqual(out["final_arn"], out["sft_arn"])

        # ... so a step of the loss GRPO trains with runs here with advantages of its own: +1 and -1 for a group's
        # samples. It moves the weights, and the sampling client of the saved weights sees it.
        from sagemaker.train.training_session import AdamParams

        probe = demo.encode("2+3=") + demo.encode("#### 5") + [demo.EOS]
        with self.svc.create_lora_training_client(demo.hub_model_arn("rlloop-tiny-moe"), rank=8, alpha=16) as tc:
            before = tc.create_sampling_client()
            before_lp = before.compute_logprobs(probe).result()
            seqs = before.sample(demo.encode("4+4="), 4, demo.sampling_params(1.0, seed=5)).result().sequences
            data = [demo.completion_datum(demo.encode("4+4="), list(s.tokens), logprobs=s.logprobs,
                                          advantages=1.0 if i % 2 else -1.0)
                    for i, s in enumerate(seqs) if s.tokens]
            self.assertTrue(data)
            loss = demo.loss_sum(tc.forward_backward(data, loss_fn="importance_sampling").result())
            self.assertTrue(math.isfinite(loss), loss)
            tc.optim_step(AdamParams(learning_rate=1e-2)).result()
            after = tc.save_weights_and_get_sampling_client()
            moved = max(abs(a - b) for a, b in zip(after.compute_logprobs(probe).result()[1:], before_lp[1:]))
            self.assertGreater(moved, 1e-4)


class SdkGrpoOnExpertsSpreadOverTwoRanks(SdkGrpoOnATinyMixtureOfExperts):
    """The same through `rlloop serve --world-size 2 --expert-parallel`: each rank holds half of every sparse
    layer's experts (and every adapter); training, saved weights and sampling run on both ranks in step."""

    SERVE_ARGS = ("--world-size", "2", "--expert-parallel")


class SdkCallsBeyondTrainingSessions(unittest.TestCase):
    """The SDK's documented calls that reach past the training-session APIs (the Hub, the model registry), and a
    batch it splits into chunks, each against what the same thing gives without the SDK."""

    @classmethod
    def setUpClass(cls):
        import boto3

        cls.server = rlloop_serve.Server(RLLOOP, max_sessions=8, extra_args=("--result-wait-ms", "1500"))
        demo.configure_environment(cls.server.endpoint, rlloop_serve.ACCESS_KEY, rlloop_serve.SECRET_KEY)
        cls.svc = demo.service_client(rlloop_serve.ACCOUNT, rlloop_serve.ROLE_ARN)
        cls.rt = boto3.client("sagemakertrainingsessionruntime", endpoint_url=cls.server.endpoint)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def boto3_forward_backward(self, session, data, sequence_number):
        """One forwardBackward of every datum in one request, through boto3; its metrics."""
        datums = [{"modelInput": {"chunks": [{"type": "encoded_text", "tokens": d.model_input.to_ints()}]},
                   "lossFnInputs": {k: {"data": v, "dtype": "int64" if k == "target_tokens" else "float32",
                                        "shape": [len(v)]} for k, v in d.loss_fn_inputs.items()}} for d in data]
        op = self.rt.execute_training_operation(
            trainingSessionName=session, clientToken=f"one-batch-{sequence_number}", sequenceNumber=sequence_number,
            operationConfig={"forwardBackward": {"lossFnName": "cross_entropy", "datumList": datums}})["operationId"]
        for _ in range(600):
            r = self.rt.get_training_operation_result(trainingSessionName=session, operationId=op)
            if r["status"] not in ("Pending", "InProgress"):
                break
            time.sleep(0.05)
        self.assertEqual(r["status"], "Completed", r)
        return r["operationResult"]["forwardBackward"]["metrics"]

    def test_hub_model_packages_and_chunked_batches(self):
        # list_base_models: ListHubContents, then DescribeHubContent for each model marked trainable.
        self.assertIn("rlloop-small", self.svc.list_base_models())

        # A base model named by its id (DescribeHubContent gives its ARN). 2,500 datums: the SDK sends 1,024,
        # 1,024 and 452 and folds the chunks' metrics as datum-weighted means (global_token_num: a sum).
        data = [demo.completion_datum(demo.encode(f"{i % 97}+{i % 13}="), demo.encode(f"#### {i % 97 + i % 13}") +
                                      [demo.EOS]) for i in range(2500)]
        tokens = sum(len(d.model_input.to_ints()) for d in data)
        with self.svc.create_lora_training_client("rlloop-small", rank=32, alpha=64) as tc, \
             self.svc.create_lora_training_client("rlloop-small", rank=32, alpha=64) as other:
            chunked = tc.forward_backward(data, loss_fn="cross_entropy").result().metrics
            # The same data as one request through boto3, on a session of the same base: its adapters start at
            # zero (LoRA's B), so both compute the base model's loss.
            whole = self.boto3_forward_backward(other.training_session_name, data, 1)
            self.assertAlmostEqual(chunked["loss"], whole["loss"], delta=1e-5 * abs(whole["loss"]))
            self.assertAlmostEqual(whole["loss"] * 2500, whole["loss:sum"], delta=1e-6 * whole["loss:sum"])
            self.assertEqual(chunked["global_token_num"], tokens)
            self.assertEqual(whole["global_token_num"], tokens)
            for m in (chunked, whole):
                self.assertGreater(m["actor/grad_norm"], 0)  # the SDK takes a split batch's from its last chunk
                self.assertGreater(m["estimated_flops"], 0)
                self.assertGreater(m["promised_flops"], 0)
                self.assertAlmostEqual(m["mfu"], m["estimated_flops"] / m["promised_flops"], delta=1e-9)
            # A policy loss reports its diagnostics; with the sampler's own logprobs the ratio is 1: nothing is
            # clipped and the estimated KL is 0.
            probe = demo.encode("2+3=") + demo.encode("#### 5") + [demo.EOS]
            lp = tc.forward([demo.completion_datum(probe[:4], probe[4:])]).result().loss_fn_outputs[0]["logprobs"]["data"]
            rl = demo.completion_datum(probe[:4], probe[4:], logprobs=lp[3:], advantages=1.0)
            ppo = tc.forward([rl], loss_fn="ppo").result().metrics
            self.assertAlmostEqual(ppo["actor/pg_loss"], ppo["loss"], delta=1e-12)
            self.assertAlmostEqual(ppo["actor/ppo_kl"], 0.0, delta=1e-5)
            self.assertEqual(ppo["actor/pg_clipfrac"], 0.0)
            # compute_logprobs: None for the first token, which has no context.
            self.assertIsNone(tc.create_sampling_client().compute_logprobs(probe).result()[0])

            # Train a step, save: the ARNs alone (DescribeModelPackage) give a training client and a sampling client.
            from sagemaker.train.training_session import AdamParams

            tc.forward_backward(data[:64], loss_fn="cross_entropy").result()
            tc.optim_step(AdamParams(learning_rate=1e-3)).result()
            state_arn = tc.save_state("after one step").result().model_package_arn
            weights_arn = tc.save_weights_for_sampler().result().model_package_arn
            trained = tc.forward([demo.completion_datum(probe[:4], probe[4:])]).result().metrics["loss"]
            sampled = tc.create_sampling_client(weights_arn).compute_logprobs(probe).result()

        # create_training_client_from_state without base_model: the package names its base (BaseModel of its
        # container), and the new session resumes from it.
        with self.svc.create_training_client_from_state(state_arn) as resumed:
            again = resumed.forward([demo.completion_datum(probe[:4], probe[4:])]).result().metrics["loss"]
            self.assertAlmostEqual(again, trained, delta=1e-5 * abs(trained))
        # A sampling client from the weights' package alone, on a session of its own.
        with self.svc.create_sampling_client(model_package_arn=weights_arn) as package_client:
            from_package = package_client.compute_logprobs(probe).result()
        self.assertIsNone(from_package[0])
        for a, b in zip(from_package[1:], sampled[1:]):
            self.assertAlmostEqual(a, b, delta=1e-5)
        # The registry lists both packages, newest first, and knows which one is a checkpoint.
        latest = self.svc.list_model_packages()
        self.assertEqual([p.model_package_arn for p in latest[:2]], [weights_arn, state_arn])
        from sagemaker.train.training_session.types import ModelPackageKind

        self.assertEqual(self.svc.get_latest_model_package(ModelPackageKind.CHECKPOINT).model_package_arn, state_arn)

def main():
    global RLLOOP
    RLLOOP = sys.argv.pop(1) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else demo.find_rlloop()
    program = unittest.main(exit=False, verbosity=2)
    sys.exit(0 if program.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
