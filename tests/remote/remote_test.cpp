// RemoteSession against rlloop-server (fake service) on loopback, through the ordinary clients.
#include <gtest/gtest.h>

#include <cstdlib>

#include <rlloop/clients.hpp>
#include <rlloop/remote.hpp>

#include "fake_service.hpp"
#include "server/server.hpp"

using namespace rlloop;

namespace {

struct RemoteFixture : ::testing::Test {
  void SetUp() override {
    server::Options opts;
    opts.tenants = {server::Tenant{"a", "111122223333", {{"AKIDREMOTE", "remote-secret"}}, {"bearer-a"}, 4, 1 << 20}};
    opts.log = [](const std::string&) {};
    service = std::make_shared<fake::FakeService>();
    srv = std::make_unique<server::Server>(opts, server::make_backend(service));
    srv->start();
  }
  void TearDown() override { srv->stop(); }

  RemoteOptions bearer() const {
    RemoteOptions o;
    o.endpoint = "http://127.0.0.1:" + std::to_string(srv->port());
    o.bearer_key = "bearer-a";
    return o;
  }

  static Datum datum(std::vector<token_id> tokens) {
    Datum d;
    d.model_input = ModelInput::from_tokens(tokens);
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(tokens);
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(tokens.size(), 1.0f));
    return d;
  }

  std::shared_ptr<fake::FakeService> service;
  std::unique_ptr<server::Server> srv;
};

}  // namespace

TEST_F(RemoteFixture, TrainingLoopThroughTheClients) {
  ServiceClient<RemoteService> svc{RemoteService(bearer())};
  EXPECT_EQ(svc.list_base_models(), (std::vector<std::string>{"tiny", "slow"}));
  EXPECT_EQ(svc.get_server_capabilities().max_lora_rank, 64);
  auto tc = svc.create_lora_training_client("slow", {.rank = 8, .alpha = 16});
  EXPECT_EQ(tc.get_info().vocab_size, 257);

  // Submitted back to back; both futures resolve, in order.
  auto fb = tc.forward_backward({datum({1, 2, 3})}, LossSpec::cross_entropy());
  auto step = tc.optim_step(AdamParams{.learning_rate = 1e-3});
  EXPECT_FALSE(fb.is_ready());  // the slow fake takes 30 ms per operation
  EXPECT_NEAR(fb.get().logprobs(0)[0], -0.02, 1e-6);
  EXPECT_EQ(step.get().metrics.at("step"), 1.0);
  EXPECT_EQ(service->sessions().back()->log(), (std::vector<std::string>{"forward_backward", "optim_step"}));
  EXPECT_EQ(tc.usage().training, 3);

  auto sampler = tc.save_weights_and_get_sampling_client("w1");
  ASSERT_TRUE(sampler.model_path());
  EXPECT_EQ(*sampler.model_path(),
            "arn:aws:sagemaker:us-east-1:111122223333:model-package/" + tc.session().name() + "/1");
  const SampleResponse r = sampler.sample(ModelInput::from_tokens({5}), 2, SamplingParams{.max_tokens = 3}).get();
  ASSERT_EQ(r.sequences.size(), 2u);
  EXPECT_EQ(r.sequences[0].tokens, (std::vector<token_id>{6, 7, 8}));
  EXPECT_EQ(tc.live_sampling_client().compute_logprobs(ModelInput::from_tokens({1, 9})).get(),
            (std::vector<double>{0.0, -0.1}));
  EXPECT_EQ(tc.usage().sample, 6);
}

TEST_F(RemoteFixture, CustomLossSendsMinusTheGradientAsWeights) {
  ServiceClient<RemoteService> svc{RemoteService(bearer())};
  auto tc = svc.create_lora_training_client("tiny");
  Datum d = datum({4, 5});
  d.loss_fn_inputs.erase("weights");
  auto out = tc.forward_backward_custom({d}, [](const std::vector<Datum>&, const std::vector<std::vector<double>>& lp) {
                 CustomLossResult r;
                 r.loss = -(2 * lp[0][0] + 3 * lp[0][1]);
                 r.grad_logprobs = {{-2.0, -3.0}};
                 r.metrics["custom"] = 1;
                 return r;
               }).get();
  EXPECT_EQ(service->sessions().back()->last_weights(), (std::vector<double>{2.0, 3.0}));
  EXPECT_NEAR(out.metrics.at("loss:sum"), 2 * 0.05 + 3 * 0.06, 1e-6);
  EXPECT_EQ(out.metrics.at("custom"), 1.0);
}

TEST_F(RemoteFixture, ErrorsCarryTheAwsNameAndStatus) {
  RemoteService remote(bearer());
  auto s = remote.create_session(SessionOptions{"tiny", LoraOptions{}, 0, "errs"});
  try {
    s->forward_backward({datum({1, 500})}, LossSpec::cross_entropy());
    FAIL();
  } catch (const remote_error& e) {
    EXPECT_EQ(e.code(), "ValidationException");
    EXPECT_EQ(e.http_status(), 400);
    EXPECT_NE(std::string(e.what()).find("token id 500"), std::string::npos);
  }
  // A runtime failure surfaces from the future.
  auto bad = s->forward_backward({datum({99, 1})}, LossSpec::cross_entropy());
  try {
    bad.get();
    FAIL();
  } catch (const remote_error& e) {
    EXPECT_EQ(e.code(), "OperationFailed");
    EXPECT_NE(std::string(e.what()).find("fake: poisoned datum"), std::string::npos);
  }
  // A catalogue name goes as its Hub ARN; one the server does not serve is the model's ResourceNotFound.
  try {
    remote.create_session(SessionOptions{"missing", LoraOptions{}, 0, "nomodel"});
    FAIL();
  } catch (const remote_error& e) {
    EXPECT_EQ(e.code(), "ResourceNotFound");
    EXPECT_NE(std::string(e.what()).find("base model missing"), std::string::npos) << e.what();
  }
  RemoteOptions wrong = bearer();
  wrong.bearer_key = "nope";
  try {
    RemoteService(wrong).list_base_models();
    FAIL();
  } catch (const remote_error& e) {
    EXPECT_EQ(e.code(), "UnrecognizedClientException");
    EXPECT_EQ(e.http_status(), 403);
  }
}

TEST_F(RemoteFixture, SigV4CredentialsFromTheEnvironment) {
  RemoteOptions o = bearer();
  o.bearer_key.reset();
  ::setenv("AWS_ACCESS_KEY_ID", "AKIDREMOTE", 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", "remote-secret", 1);
  RemoteService remote(o);
  auto s = remote.create_session(SessionOptions{"tiny", LoraOptions{}, 0, "signed"});
  EXPECT_EQ(s->optim_step(AdamParams{}).get().metrics.at("step"), 1.0);
  ::setenv("AWS_SECRET_ACCESS_KEY", "wrong", 1);
  try {
    RemoteService(o).list_base_models();
    FAIL();
  } catch (const remote_error& e) {
    EXPECT_EQ(e.code(), "SignatureDoesNotMatch");
  }
  ::unsetenv("AWS_ACCESS_KEY_ID");
  ::unsetenv("AWS_SECRET_ACCESS_KEY");
}

TEST_F(RemoteFixture, GivesUpWithAnIoErrorAfterRetryingADeadServer) {
  RemoteOptions o = bearer();
  srv->stop();
  o.max_retries = 2;
  o.backoff_base = std::chrono::milliseconds(1);
  EXPECT_THROW(RemoteService(o).list_base_models(), io_error);
}
