"""boto3, as a SageMaker user calls it, against `rlloop serve`: every training-session operation of AWS's two
service models (control plane `sagemaker`, runtime `sagemakertrainingsessionruntime`), their errors as the
modelled exception classes, pagination, idempotent client tokens and operations polled to completion. Every
response body is also checked against the model's output or error shape by service_models.validate (strict: no
unknown members, every bound and enum), so a reply that botocore parses but AWS would not send fails here.

Usage: python boto3_test.py <rlloop binary>      (run by ctest with third_party/venv's Python)
"""

import json
import sys
import time
import unittest

import boto3
import botocore.config
from botocore.exceptions import ClientError, ParamValidationError

import rlloop_serve
import service_models

RLLOOP = None
MODEL = "rlloop-tiny"
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [72, 105, 33]}]}


def datum(tokens, targets, weights):
    return {
        "modelInput": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "lossFnInputs": {
            "target_tokens": {"data": targets, "dtype": "int64", "shape": [len(targets)]},
            "weights": {"data": weights, "dtype": "float32", "shape": [len(weights)]},
        },
    }


class Checked:
    """Registers a botocore hook that validates each raw response body against the operation's model shapes."""

    def __init__(self, client):
        self.checked = []
        client.meta.events.register("after-call", self.after_call)
        client.meta.events.register("needs-retry", self.check_error, unique_id="rlloop-error-check")

    def after_call(self, http_response, parsed, model, **_):
        if http_response.status_code >= 300:
            return  # error bodies are checked against the error shapes by check_error
        op = model.name
        if op in ("SampleTrainingSession", "SampleTrainingSessionWithResponseStream"):
            self.checked.append(op)  # the body is an opaque blob (OpenAI JSON); tested by content below
            return
        body = json.loads(http_response.content or b"{}")
        service_models.validate(model.output_shape, body, op)
        self.checked.append(op)

    def check_error(self, response, operation, **_):
        if not response or response[0].status_code < 300:
            return None
        http = response[0]
        code = http.headers.get("x-amzn-errortype", "").split(":")[0]
        body = json.loads(http.content or b"{}")
        code = code or body.get("__type", "").split("#")[-1]
        body.pop("__type", None)  # JSON 1.1's error code, part of the protocol, not of the shape
        shapes = {e.name: e for e in operation.error_shapes}
        if code in shapes:
            service_models.validate(shapes[code], body, code)
        return None


class Boto3AgainstServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = rlloop_serve.Server(RLLOOP, max_sessions=4)
        session = boto3.session.Session(
            aws_access_key_id=rlloop_serve.ACCESS_KEY,
            aws_secret_access_key=rlloop_serve.SECRET_KEY,
            region_name=rlloop_serve.REGION,
        )
        config = botocore.config.Config(retries={"max_attempts": 1})
        cls.sm = session.client("sagemaker", endpoint_url=cls.server.endpoint, config=config)
        cls.rt = session.client("sagemakertrainingsessionruntime", endpoint_url=cls.server.endpoint, config=config)
        cls.sm_check = Checked(cls.sm)
        cls.rt_check = Checked(cls.rt)
        cls.seq = {}

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    # ---- helpers -------------------------------------------------------------------------------------------

    def create(self, name, rank=4):
        arn = self.sm.create_training_session(
            TrainingSessionName=name,
            RoleArn=rlloop_serve.ROLE_ARN,
            LoraConfig={"Rank": rank, "Alpha": 2 * rank},
            ModelConfig={"BaseModelArn": rlloop_serve.hub_model_arn(MODEL)},
            OutputConfig={"S3Location": {"Path": "s3://rlloop-test/out/"}},
            Tags=[{"Key": "team", "Value": "rl loop"}],
        )["TrainingSessionArn"]
        self.addCleanup(self.remove, name)
        self.assertEqual(arn, f"arn:aws:sagemaker:{rlloop_serve.REGION}:{rlloop_serve.ACCOUNT}:training-session/{name}")
        for _ in range(800):
            status = self.describe(name)["TrainingSessionStatus"]
            if status == "Running":
                return arn
            self.assertIn(status, ("Created", "Scheduled"))
            time.sleep(0.025)
        self.fail(f"{name} never became Running")

    def remove(self, name):
        """Stops and deletes a session (the tenant's limit counts every session until it is deleted)."""
        try:
            self.sm.stop_training_session(TrainingSessionName=name)
            for _ in range(400):
                if self.describe(name)["TrainingSessionStatus"] in ("Stopped", "Failed"):
                    break
                time.sleep(0.025)
            self.sm.delete_training_session(TrainingSessionName=name)
        except self.sm.exceptions.ResourceNotFound:
            pass  # the test deleted it itself

    def describe(self, name):
        return self.sm.describe_training_session(TrainingSessionName=name)["TrainingSessionDetail"]

    def train(self, name, config, client_token=None):
        self.seq[name] = self.seq.get(name, 0) + 1
        args = dict(trainingSessionName=name, sequenceNumber=self.seq[name], operationConfig=config)
        if client_token:
            args["clientToken"] = client_token
        return self.rt.execute_training_operation(**args)["operationId"]

    def wait_training(self, name, op_id):
        for _ in range(2000):
            r = self.rt.get_training_operation_result(trainingSessionName=name, operationId=op_id)
            if r["status"] in ("Completed", "Failed", "Skipped"):
                return r
            self.assertIn(r["status"], ("Pending", "InProgress"))
            time.sleep(0.01)
        self.fail(f"training operation {op_id} never finished")

    def wait_sampling(self, name, op_id):
        for _ in range(2000):
            r = self.rt.get_sampling_operation_result(trainingSessionName=name, operationId=op_id)
            if r["status"] in ("Completed", "Failed", "Skipped"):
                return r
            time.sleep(0.01)
        self.fail(f"sampling operation {op_id} never finished")

    def completed(self, r):
        self.assertEqual(r["status"], "Completed", r.get("errorDetails"))
        return r["operationResult"]

    # ---- control plane -----------------------------------------------------------------------------------

    def test_control_plane_lifecycle_and_errors(self):
        arn = self.create("ctl-a")
        d = self.describe("ctl-a")
        self.assertEqual(d["TrainingSessionArn"], arn)
        self.assertEqual(d["TrainingSessionName"], "ctl-a")
        self.assertEqual(d["LoraConfig"], {"Rank": 4, "Alpha": 8})
        self.assertEqual(d["Tags"], [{"Key": "team", "Value": "rl loop"}])
        self.assertEqual(d["ModelConfig"]["BaseModelArn"], rlloop_serve.hub_model_arn(MODEL))
        self.assertEqual(d["BillableTokenUsage"]["TrainingTokenCount"], 0)
        self.assertEqual(d["CreationTime"].tzinfo is not None, True)  # parsed as a timestamp

        with self.assertRaises(self.sm.exceptions.ResourceInUse) as e:
            self.create("ctl-a")
        self.assertIn("ctl-a", e.exception.response["Error"]["Message"])
        with self.assertRaises(self.sm.exceptions.ResourceNotFound) as e:
            self.sm.describe_training_session(TrainingSessionName="no-such-session")
        self.assertIn("no-such-session", e.exception.response["Error"]["Message"])
        with self.assertRaises(self.sm.exceptions.ResourceNotFound) as e:
            self.sm.create_training_session(
                TrainingSessionName="ctl-unknown-model", RoleArn=rlloop_serve.ROLE_ARN,
                LoraConfig={"Rank": 4, "Alpha": 8},
                ModelConfig={"BaseModelArn": rlloop_serve.hub_model_arn("no-such-model")},
                OutputConfig={"S3Location": {"Path": "s3://rlloop-test/out/"}})
        self.assertIn("no-such-model", e.exception.response["Error"]["Message"])
        with self.assertRaises(ClientError) as e:
            self.sm.create_training_session(
                TrainingSessionName="ctl-bad-rank", RoleArn=rlloop_serve.ROLE_ARN, LoraConfig={"Rank": 999, "Alpha": 8},
                ModelConfig={"BaseModelArn": rlloop_serve.hub_model_arn(MODEL)},
                OutputConfig={"S3Location": {"Path": "s3://rlloop-test/out/"}})
        self.assertEqual(e.exception.response["Error"]["Code"], "ValidationException")
        self.assertIn("LoraConfig.Rank", e.exception.response["Error"]["Message"])

        self.sm.stop_training_session(TrainingSessionName="ctl-a")
        for _ in range(400):
            if self.describe("ctl-a")["TrainingSessionStatus"] == "Stopped":
                break
            time.sleep(0.025)
        d = self.describe("ctl-a")
        self.assertEqual(d["TrainingSessionStatus"], "Stopped")
        self.assertIn("EndTime", d)
        self.sm.delete_training_session(TrainingSessionName="ctl-a")
        with self.assertRaises(self.sm.exceptions.ResourceNotFound):
            self.describe("ctl-a")
        with self.assertRaises(self.sm.exceptions.ResourceNotFound):
            self.sm.delete_training_session(TrainingSessionName="ctl-a")

    def test_list_paginates_and_filters(self):
        names = ["lst-1", "lst-2", "lst-3"]
        for n in names:
            self.create(n)
        pages = list(self.sm.get_paginator("list_training_sessions").paginate(NameContains="lst-", PaginationConfig={"PageSize": 1}))
        arns = [s["TrainingSessionArn"] for p in pages for s in p["TrainingSessionSummaries"]]
        self.assertEqual(len(pages), 3)
        self.assertEqual(sorted(a.rsplit("/", 1)[1] for a in arns), names)
        running = self.sm.list_training_sessions(NameContains="lst-", StatusEquals="Running")["TrainingSessionSummaries"]
        self.assertEqual(len(running), 3)
        stopped = self.sm.list_training_sessions(NameContains="lst-", StatusEquals="Stopped")["TrainingSessionSummaries"]
        self.assertEqual(stopped, [])
        with self.assertRaises(ClientError) as e:
            self.sm.list_training_sessions(StatusEquals="Sleeping")
        self.assertEqual(e.exception.response["Error"]["Code"], "ValidationException")
        self.assertIn("StatusEquals", e.exception.response["Error"]["Message"])

    def test_session_limit_is_resource_limit_exceeded(self):
        # max_sessions = 4 for the tenant, and every test deletes its sessions when it ends.
        for i in range(4):
            self.create(f"lim-{i}")
        with self.assertRaises(self.sm.exceptions.ResourceLimitExceeded) as e:
            self.create("lim-4")
        self.assertIn("limit", e.exception.response["Error"]["Message"])

    # ---- model registry and Hub (the SageMaker SDK's calls beyond training sessions) ------------------------

    def test_model_registry_and_hub(self):
        name = "registry"
        self.create(name)
        group = f"arn:aws:sagemaker:{rlloop_serve.REGION}:{rlloop_serve.ACCOUNT}:model-package-group/registry-group"
        saved = {kind: self.completed(self.wait_training(name, self.train(name, {kind: {}})))[kind]["modelPackageArn"]
                 for kind in ("saveState", "saveWeights")}
        for kind, arn in saved.items():
            d = self.sm.describe_model_package(ModelPackageName=arn)
            self.assertEqual(d["ModelPackageArn"], arn)
            self.assertEqual(d["ModelPackageStatus"], "Completed")
            self.assertEqual(d["ModelPackageVersion"], int(arn.rsplit("/", 1)[1]))
            [container] = d["InferenceSpecification"]["Containers"]
            self.assertEqual(container["BaseModel"], {"HubContentName": MODEL, "HubContentVersion": "1.0.0"})
            self.assertEqual(container["IsCheckpoint"], kind == "saveState")
        with self.assertRaises(botocore.exceptions.ClientError) as e:
            self.sm.describe_model_package(ModelPackageName=saved["saveState"].replace(rlloop_serve.ACCOUNT, "999999999999"))
        self.assertEqual(e.exception.response["Error"]["Code"], "ValidationException")
        self.assertIn("does not exist", e.exception.response["Error"]["Message"])

        # The session was created without a group: listing by another group finds nothing; by the session's name,
        # newest first, in pages.
        self.assertEqual(self.sm.list_model_packages(ModelPackageGroupName=group)["ModelPackageSummaryList"], [])
        first = self.sm.list_model_packages(NameContains=name, MaxResults=1, SortBy="CreationTime", SortOrder="Descending")
        self.assertEqual([p["ModelPackageArn"] for p in first["ModelPackageSummaryList"]], [saved["saveWeights"]])
        rest = self.sm.list_model_packages(NameContains=name, MaxResults=1, NextToken=first["NextToken"])
        self.assertEqual([p["ModelPackageArn"] for p in rest["ModelPackageSummaryList"]], [saved["saveState"]])
        with self.assertRaises(botocore.exceptions.ClientError) as e:
            self.sm.list_model_packages(SortBy="Size")
        self.assertIn("SortBy", e.exception.response["Error"]["Message"])

        listed = self.sm.list_hub_contents(HubName="SageMakerPublicHub", HubContentType="Model")["HubContentSummaries"]
        names = [c["HubContentName"] for c in listed]
        self.assertIn(MODEL, names)
        for c in listed:
            self.assertIn("@capability:training_session", c["HubContentSearchKeywords"])
        d = self.sm.describe_hub_content(HubName="SageMakerPublicHub", HubContentType="Model", HubContentName=MODEL)
        self.assertEqual(d["HubContentArn"], rlloop_serve.hub_model_arn(MODEL))
        self.assertEqual(json.loads(d["HubContentDocument"]).get("HuggingfaceId"), None)
        for call in (lambda: self.sm.describe_hub_content(HubName="SageMakerPublicHub", HubContentType="Model",
                                                          HubContentName="no-such-model"),
                     lambda: self.sm.list_hub_contents(HubName="PrivateHub", HubContentType="Model")):
            with self.assertRaises(self.sm.exceptions.ResourceNotFound):
                call()
        for op in ("DescribeModelPackage", "ListModelPackages", "ListHubContents", "DescribeHubContent"):
            self.assertIn(op, self.sm_check.checked)  # every answer was validated against the model's shape

    # ---- runtime: training -------------------------------------------------------------------------------

    def test_training_operations(self):
        name = "rt-train"
        self.create(name)
        batch = [datum([72, 105, 33, 10], [105, 33, 10, 0], [0.0, 1.0, 1.0, 1.0])]
        fb = self.completed(self.wait_training(name, self.train(
            name, {"forwardBackward": {"lossFnName": "cross_entropy", "datumList": batch}})))["forwardBackward"]
        self.assertEqual(fb["tokenUsage"]["trainingTokens"], 4)
        self.assertEqual(len(fb["lossFnOutputs"]), 1)
        logprobs = fb["lossFnOutputs"][0]["logprobs"]
        self.assertEqual(logprobs["shape"], [4])
        loss = fb["metrics"]["loss:sum"]
        self.assertAlmostEqual(loss, -sum(logprobs["data"][1:]), places=4)

        step = self.completed(self.wait_training(name, self.train(
            name, {"optimizerStep": {"adamParamsConfig": {"learningRate": 0.01}}})))
        self.assertIn("optimizerStep", step)
        fwd = self.completed(self.wait_training(name, self.train(
            name, {"forward": {"lossFnName": "cross_entropy", "datumList": batch}})))["forward"]
        self.assertLess(fwd["metrics"]["loss:sum"], loss)  # one step of lr 0.01 on the same batch lowers it

        state_arn = self.completed(self.wait_training(name, self.train(
            name, {"saveState": {"description": "after one step"}})))["saveState"]["modelPackageArn"]
        self.assertRegex(state_arn, r"^arn:aws:sagemaker:us-west-2:111122223333:model-package/")
        weights_arn = self.completed(self.wait_training(name, self.train(
            name, {"saveWeights": {"mergeWeights": False}})))["saveWeights"]["modelPackageArn"]
        self.assertNotEqual(weights_arn, state_arn)
        self.completed(self.wait_training(name, self.train(
            name, {"optimizerStep": {"adamParamsConfig": {"learningRate": 0.01}}})))
        self.completed(self.wait_training(name, self.train(
            name, {"loadState": {"modelPackageArn": state_arn, "loadOptimizer": True}})))
        again = self.completed(self.wait_training(name, self.train(
            name, {"forward": {"lossFnName": "cross_entropy", "datumList": batch}})))["forward"]
        self.assertAlmostEqual(again["metrics"]["loss:sum"], fwd["metrics"]["loss:sum"], places=5)

        # Importance sampling and PPO take the sampler's logprobs and advantages.
        rl = datum([72, 105, 33, 10], [105, 33, 10, 0], [0.0, 1.0, 1.0, 1.0])
        rl["lossFnInputs"]["logprobs"] = {"data": [0.0, -5.0, -5.0, -5.0], "dtype": "float32", "shape": [4]}
        rl["lossFnInputs"]["advantages"] = {"data": [0.0, 1.0, 1.0, 1.0], "dtype": "float32", "shape": [4]}
        for loss_name in ("importance_sampling", "ppo", "cispo"):
            r = self.completed(self.wait_training(name, self.train(
                name, {"forwardBackward": {"lossFnName": loss_name, "datumList": [rl]}})))
            self.assertIn("loss:sum", r["forwardBackward"]["metrics"], loss_name)
        d = self.describe(name)
        self.assertEqual(d["LastReceivedSequenceNumber"], self.seq[name])
        self.assertGreater(d["BillableTokenUsage"]["TrainingTokenCount"], 0)

    def test_training_errors_are_modelled_exceptions(self):
        name = "rt-errors"
        self.create(name)
        batch = [datum([72, 105], [105, 33], [1.0, 1.0])]
        with self.assertRaises(self.rt.exceptions.ValidationException) as e:
            self.rt.execute_training_operation(trainingSessionName=name, sequenceNumber=1, operationConfig={
                "forwardBackward": {"lossFnName": "cross_entropy", "datumList": [datum([72, 999999], [1, 2], [1.0, 1.0])]}})
        self.assertIn("999999", e.exception.response["Error"]["Message"])
        with self.assertRaises(self.rt.exceptions.ValidationException) as e:
            self.rt.execute_training_operation(trainingSessionName=name, sequenceNumber=1, operationConfig={
                "optimizerStep": {"adamParamsConfig": {"learningRate": 0.5}}})
        self.assertIn("learningRate", e.exception.response["Error"]["Message"])
        with self.assertRaises(self.rt.exceptions.ResourceNotFoundException):
            self.rt.execute_training_operation(trainingSessionName="no-such-session", sequenceNumber=1, operationConfig={
                "forward": {"lossFnName": "cross_entropy", "datumList": batch}})
        with self.assertRaises(self.rt.exceptions.ResourceNotFoundException):
            self.rt.get_training_operation_result(trainingSessionName=name, operationId="op-0-999")
        with self.assertRaises(ParamValidationError):  # botocore's own check of the model's min 1
            self.rt.execute_training_operation(trainingSessionName=name, sequenceNumber=0, operationConfig={
                "forward": {"lossFnName": "cross_entropy", "datumList": batch}})

        # Idempotency: the same client token and parameters give the same operation; a reused sequence number
        # with another token is invalid (the model's ValidationException names "invalid sequence numbers").
        op = self.rt.execute_training_operation(trainingSessionName=name, sequenceNumber=1, clientToken="tok-1",
                                                operationConfig={"forward": {"lossFnName": "cross_entropy", "datumList": batch}})
        again = self.rt.execute_training_operation(trainingSessionName=name, sequenceNumber=1, clientToken="tok-1",
                                                   operationConfig={"forward": {"lossFnName": "cross_entropy", "datumList": batch}})
        self.assertEqual(op["operationId"], again["operationId"])
        self.completed(self.wait_training(name, op["operationId"]))
        with self.assertRaises(self.rt.exceptions.ValidationException) as e:
            self.rt.execute_training_operation(trainingSessionName=name, sequenceNumber=1, clientToken="tok-2",
                                               operationConfig={"forward": {"lossFnName": "cross_entropy", "datumList": batch}})
        self.assertIn("sequenceNumber", e.exception.response["Error"]["Message"])

        # A model package the tenant does not own, of another account or of none, is known at submission.
        self.seq[name] = 1
        for account in (rlloop_serve.ACCOUNT, "999999999999"):
            with self.assertRaises(self.rt.exceptions.ResourceNotFoundException) as e:
                self.rt.execute_training_operation(trainingSessionName=name, sequenceNumber=2, operationConfig={
                    "loadState": {"modelPackageArn": f"arn:aws:sagemaker:us-west-2:{account}:model-package/none/1",
                                  "loadOptimizer": False}})
            self.assertIn("does not exist in this account", e.exception.response["Error"]["Message"])
        # A failed operation (the critic's loss on a session without a value head): the session stays usable and
        # later operations run.
        critic = datum([72, 105], [105, 33], [1.0, 1.0])
        critic["lossFnInputs"]["returns"] = {"data": [0.5, 0.5], "dtype": "float32", "shape": [2]}
        failed = self.wait_training(name, self.train(
            name, {"forwardBackward": {"lossFnName": "value", "datumList": [critic]}}))
        self.assertIn(failed["status"], ("Failed",))
        self.assertTrue(failed["errorDetails"])
        self.completed(self.wait_training(name, self.train(name, {"forward": {"lossFnName": "cross_entropy", "datumList": batch}})))

        self.sm.stop_training_session(TrainingSessionName=name)
        for _ in range(400):
            if self.describe(name)["TrainingSessionStatus"] == "Stopped":
                break
            time.sleep(0.025)
        with self.assertRaises(self.rt.exceptions.ConflictException):
            self.train(name, {"forward": {"lossFnName": "cross_entropy", "datumList": batch}})

    # ---- runtime: sampling -------------------------------------------------------------------------------

    def test_sampling_operations(self):
        name = "rt-sample"
        self.create(name)
        params = {"maxTokens": 512, "temperature": 1.0, "seed": 7, "stop": ["!"]}
        r = self.completed(self.wait_sampling(name, self.rt.execute_sampling_operation(
            trainingSessionName=name, operationConfig={"sample": {
                "prompt": PROMPT, "numSamples": 3, "samplingParams": params, "includePromptLogprobs": True,
                "topkPromptLogprobs": 2}})["operationId"]))["sample"]
        self.assertEqual(len(r["sequences"]), 3)
        for s in r["sequences"]:
            self.assertIn(s["stopReason"], ("stop", "length"))
            self.assertEqual(len(s["logprobs"]), len(s["tokens"]))
            self.assertEqual(s["tokenUsage"]["decode"], len(s["tokens"]))
            self.assertLessEqual(len(s["tokens"]), 512)
        self.assertEqual(len(r["promptLogprobs"]), 3)
        self.assertEqual(len(r["topkPromptLogprobs"]), 3)
        again = self.completed(self.wait_sampling(name, self.rt.execute_sampling_operation(
            trainingSessionName=name, operationConfig={"sample": {
                "prompt": PROMPT, "numSamples": 3, "samplingParams": params}})["operationId"]))["sample"]
        self.assertEqual([s["tokens"] for s in again["sequences"]], [s["tokens"] for s in r["sequences"]])

        scored = self.completed(self.wait_sampling(name, self.rt.execute_sampling_operation(
            trainingSessionName=name, operationConfig={"computeLogprobs": {"prompt": PROMPT}})["operationId"]))
        self.assertEqual(len(scored["computeLogprobs"]["logprobs"]), 3)
        self.assertIsNone(scored["computeLogprobs"]["logprobs"][0])  # JSON null: no context before the first token
        for a, b in zip(scored["computeLogprobs"]["logprobs"][1:], r["promptLogprobs"][1:]):
            self.assertAlmostEqual(a, b, places=5)

        weights_arn = self.completed(self.wait_training(name, self.train(name, {"saveWeights": {}})))["saveWeights"]["modelPackageArn"]
        self.completed(self.wait_sampling(name, self.rt.execute_sampling_operation(
            trainingSessionName=name, operationConfig={"loadWeightsForSampling": {"modelPackageArn": weights_arn}})["operationId"]))
        from_ckpt = self.completed(self.wait_sampling(name, self.rt.execute_sampling_operation(
            trainingSessionName=name, operationConfig={"sample": {
                "prompt": PROMPT, "numSamples": 3, "samplingParams": params, "modelPackageArn": weights_arn}})["operationId"]))
        # Nothing trained since the start: the checkpoint's weights are the session's, so the tokens agree.
        self.assertEqual([s["tokens"] for s in from_ckpt["sample"]["sequences"]], [s["tokens"] for s in r["sequences"]])
        usage = self.describe(name)["BillableTokenUsage"]
        self.assertGreater(usage["SampleTokenCount"], 0)
        self.assertGreater(usage["PrefillTokenCount"], 0)

        with self.assertRaises(ParamValidationError):  # the model's min: botocore refuses before sending
            self.rt.execute_sampling_operation(trainingSessionName=name, operationConfig={"sample": {
                "prompt": PROMPT, "numSamples": 1, "samplingParams": {"maxTokens": 16}}})
        with self.assertRaises(self.rt.exceptions.ValidationException) as e:
            self.rt.execute_sampling_operation(trainingSessionName=name, operationConfig={"sample": {
                "prompt": PROMPT, "numSamples": 1, "samplingParams": {"maxTokens": 512, "topP": 1.5}}})
        self.assertIn("topP", e.exception.response["Error"]["Message"])
        with self.assertRaises(self.rt.exceptions.ResourceNotFoundException):
            self.rt.get_sampling_operation_result(trainingSessionName=name, operationId="op-0-999")

    def test_sample_training_session_passthrough(self):
        name = "rt-chat"
        self.create(name)
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 3})
        r = self.rt.sample_training_session(trainingSessionName=name, contentType="application/json", body=body)
        self.assertEqual(r["contentType"], "application/json")
        reply = json.loads(r["body"].read())
        self.assertEqual(reply["object"], "chat.completion")
        self.assertLessEqual(reply["usage"]["completion_tokens"], 8)

        stream = self.rt.sample_training_session_with_response_stream(
            trainingSessionName=name, contentType="application/json", accept="text/event-stream", body=body)
        self.assertEqual(stream["contentType"], "text/event-stream")
        events = [l for l in stream["body"].read().decode().splitlines() if l.startswith("data: ")]
        self.assertEqual(events[-1], "data: [DONE]")
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        self.assertTrue(all(c["object"] == "chat.completion.chunk" for c in chunks))
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        self.assertEqual(streamed, reply["choices"][0]["message"]["content"])

        with self.assertRaises(self.rt.exceptions.ValidationException) as e:
            self.rt.sample_training_session(trainingSessionName=name, body=b"{not json")
        self.assertIn("JSON", e.exception.response["Error"]["Message"])
        with self.assertRaises(self.rt.exceptions.ResourceNotFoundException):
            self.rt.sample_training_session(trainingSessionName="no-such-session", body=body)
        with self.assertRaises(self.rt.exceptions.ResourceNotFoundException):
            self.rt.sample_training_session(trainingSessionName=name, body=body,
                                            modelPackageArn=f"arn:aws:sagemaker:us-west-2:{rlloop_serve.ACCOUNT}:model-package/none/1")


def main():
    global RLLOOP
    RLLOOP = sys.argv.pop(1)
    program = unittest.main(exit=False, verbosity=2)
    # Coverage of the models: every operation of both must have been called with success by some test.
    called = set(Boto3AgainstServer.sm_check.checked) | set(Boto3AgainstServer.rt_check.checked)
    expected = set(service_models.CONTROL_OPERATIONS) | set(service_models.load(service_models.RUNTIME).operation_names)
    missing = expected - called
    if missing:
        print(f"FAIL: operations of the models never called successfully: {sorted(missing)}")
        sys.exit(1)
    sys.exit(0 if program.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
