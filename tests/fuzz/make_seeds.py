#!/usr/bin/env python3
"""Writes the hand-made seed inputs of the api_fuzz target into seeds/ (the starting corpus; see README.md)."""
import json, os, pathlib

out = pathlib.Path(__file__).parent / "seeds"
out.mkdir(exist_ok=True)
SEP = "\n---next---\n"


def req(method, target, body="", headers=()):
    lines = [f"{method} {target}"] + [f"{k}: {v}" for k, v in headers]
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    return "\n".join(lines) + "\n\n" + body


def cp(op, body):
    return req("POST", "/", body, [("X-Amz-Target", "SageMaker." + op), ("Content-Type", "application/x-amz-json-1.1")])


create = {"TrainingSessionName": "t2", "RoleArn": "arn:aws:iam::111122223333:role/Fuzz", "LoraConfig": {"Rank": 4, "Alpha": 8},
          "ModelConfig": {"BaseModelArn": "tiny", "AcceptEula": True}, "OutputConfig": {"S3Location": {"Path": "s3://b/o/"}},
          "Tags": [{"Key": "k", "Value": "v"}]}
hub = dict(create, ModelConfig={"BaseModelArn": "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/tiny/1.0.0"})
datum = {"modelInput": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
         "lossFnInputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
                          "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32", "shape": [3]},
                          "logprobs": {"data": [-1.0, -1.0, -1.0], "dtype": "float32", "shape": [3]},
                          "advantages": {"data": [0.5, 0.5, 0.5], "dtype": "float32", "shape": [3]}}}
fb = {"sequenceNumber": 1, "clientToken": "tok-1", "operationConfig": {"forwardBackward": {"datumList": [datum], "lossFnName": "cross_entropy"}}}
ppo = {"sequenceNumber": 2, "operationConfig": {"forward": {"datumList": [datum], "lossFnName": "ppo",
                                                             "lossFnConfig": {"clip_low_threshold": 0.2, "clip_high_threshold": 1.2}}}}
step = {"sequenceNumber": 3, "operationConfig": {"optimizerStep": {"adamParamsConfig": {"learningRate": 0.001, "beta1": 0.9, "beta2": 0.95,
                                                                                        "epsilon": 1e-8, "weightDecay": 0.0, "gradClipNorm": 1.0}}}}
save = {"sequenceNumber": 4, "operationConfig": {"saveWeights": {"mergeWeights": False, "description": "w"}}}
save_state = {"sequenceNumber": 5, "operationConfig": {"saveState": {"description": "st"}}}
load = {"sequenceNumber": 6, "operationConfig": {"loadState": {"modelPackageArn": "arn:aws:sagemaker:us-east-1:111122223333:model-package/s/1",
                                                               "loadOptimizer": True}}}
sample = {"operationConfig": {"sample": {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [104, 105]}]}, "numSamples": 2,
                                         "samplingParams": {"maxTokens": 512, "temperature": 0.7, "topK": -1, "topP": 0.9, "seed": 1,
                                                            "stop": ["x"], "stopTokenIds": [0]},
                                         "includePromptLogprobs": True, "topkPromptLogprobs": 2}}}
logprobs = {"operationConfig": {"computeLogprobs": {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}}}
lwfs = {"operationConfig": {"loadWeightsForSampling": {"modelPackageArn": "arn:aws:sagemaker:us-east-1:111122223333:model-package/s/1"}}}
chat = {"model": "s", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 4, "n": 2, "temperature": 0.5, "stop": ["\n"], "seed": 3, "logprobs": True, "top_logprobs": 0}
completion = {"model": "s", "prompt": "abc", "max_tokens": 3, "stream": True, "stop": "z"}

seeds = {
    "cp_create": cp("CreateTrainingSession", create),
    "cp_create_hub": cp("CreateTrainingSession", hub),
    "cp_describe": cp("DescribeTrainingSession", {"TrainingSessionName": "s"}),
    "cp_list": cp("ListTrainingSessions", {"NameContains": "s", "StatusEquals": "Running", "MaxResults": 1, "NextToken": "0",
                                           "CreationTimeAfter": 0, "CreationTimeBefore": 9e9}),
    "cp_stop_delete": cp("StopTrainingSession", {"TrainingSessionName": "s"}) + SEP + cp("DeleteTrainingSession", {"TrainingSessionName": "s"})
                      + SEP + req("POST", "/v1/training-sessions/s/operations", fb),
    "rt_fb_get": req("POST", "/v1/training-sessions/s/operations", fb) + SEP + req("GET", "/v1/training-sessions/s/operations/op-1-1"),
    "rt_fb_longpoll": req("POST", "/v1/training-sessions/s/operations", fb) + SEP
                      + req("GET", "/v1/training-sessions/s/operations/op-1-1?waitSeconds=1") + SEP
                      + req("GET", "/v1/training-sessions/s/sampling-operations/op-1-1?x=1&waitSeconds=21"),
    "rt_fb_retry": req("POST", "/v1/training-sessions/s/operations", fb) + SEP + req("POST", "/v1/training-sessions/s/operations", fb),
    "rt_ppo": req("POST", "/v1/training-sessions/s/operations", ppo),
    "rt_step": req("POST", "/v1/training-sessions/s/operations", step),
    "rt_save_load": req("POST", "/v1/training-sessions/s/operations", save) + SEP + req("POST", "/v1/training-sessions/s/operations", save_state)
                    + SEP + req("POST", "/v1/training-sessions/s/operations", load),
    "rt_sample": req("POST", "/v1/training-sessions/s/sampling-operations", sample),
    "rt_sample_retry": req("POST", "/v1/training-sessions/s/sampling-operations", sample, [("Idempotency-Key", "k-1")]) + SEP
                       + req("POST", "/v1/training-sessions/s/sampling-operations", sample, [("Idempotency-Key", "k-1")]) + SEP
                       + req("POST", "/v1/training-sessions/s/sampling-operations", logprobs, [("Idempotency-Key", "k-1")]),
    "rt_logprobs": req("POST", "/v1/training-sessions/s/sampling-operations", logprobs),
    "rt_lwfs": req("POST", "/v1/training-sessions/s/sampling-operations", lwfs),
    "rt_info": req("GET", "/v1/training-sessions/s/info"),
    "rt_misc": req("GET", "/v1/usage") + SEP + req("GET", "/v1/base-models") + SEP + req("GET", "/v1/capabilities"),
    "oa_models": req("GET", "/v1/models"),
    "oa_chat": req("POST", "/v1/chat/completions", chat),
    "oa_completion_stream": req("POST", "/v1/completions", completion),
    "oa_passthrough": req("POST", "/training-sessions/s/sample", {"prompt": "hi", "max_tokens": 2}),
    "oa_passthrough_stream": req("POST", "/training-sessions/s/sample-with-response-stream", {"messages": [{"role": "user", "content": "x"}]}),
    "bad_json": req("POST", "/v1/training-sessions/s/operations", "{\"sequenceNumber\": 1, "),
    "bad_union": req("POST", "/v1/training-sessions/s/operations", {"sequenceNumber": 1, "operationConfig": {"fly": {}}}),
    "bad_cp_json": cp("CreateTrainingSession", "[1,2"),
    "bad_auth": req("GET", "/v1/usage", "", [("Authorization", "AWS4-HMAC-SHA256 Credential=AKIDFUZZA/20250101/us-east-1/sagemaker/aws4_request, "
                                                                "SignedHeaders=host;x-amz-date, Signature=00")]),
    "bad_bearer": req("GET", "/v1/usage", "", [("Authorization", "Bearer nope")]),
    "tenant_b": req("GET", "/v1/training-sessions/s/info", "", [("Authorization", "Bearer fuzz-b")]),
    "unknown_path": req("DELETE", "/v1/training-sessions/s/operations/x/y?z=1"),
    "health": req("GET", "/health"),
}
for name, text in seeds.items():
    (out / name).write_text(text)
print(f"wrote {len(seeds)} seeds to {out}")
