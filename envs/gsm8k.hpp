// GSM8K: grade-school math word problems (official JSONL: {"question", "answer"}, the answer ending in
// "#### N"). The data set is not shipped; get test.jsonl / train.jsonl from https://github.com/openai/grade-school-math
// and pass the path.
#pragma once
#include <string>
#include <vector>

#include <rlloop/env.hpp>
#include <rlloop/envs/jsonl.hpp>
#include <rlloop/rewards/math.hpp>

namespace rlloop::envs {

struct MathProblem {
  std::string id;  // "<file stem>-<line>"
  std::string question;
  std::string solution;  // the reference worked solution, "... #### 72"
  std::string answer;    // the reference final answer, "72"
  std::string prompt;    // what the model sees: question + instruction
};

struct Gsm8kOptions {
  // Appended to each question; the reward finds the answer after "####" or in \boxed{}.
  std::string instruction = "\nSolve step by step, then give the final answer on its own line as: #### <number>";
  std::size_t limit = 0;  // read at most this many problems (0 = all)
};

inline std::vector<MathProblem> load_gsm8k(const std::string& path, const Gsm8kOptions& opts = {}) {
  std::vector<MathProblem> out;
  std::string stem = path.substr(path.find_last_of('/') + 1);
  stem = stem.substr(0, stem.find('.'));
  detail::for_each_jsonl(path, [&](const nlohmann::json& j, std::size_t line) {
    MathProblem p;
    p.id = stem + "-" + std::to_string(line);
    p.question = detail::required_string(j, "question", path, line);
    p.solution = detail::required_string(j, "answer", path, line);
    auto final_answer = rewards::extract_after_hashes(p.solution);
    if (!final_answer)
      throw invalid_argument(path + ":" + std::to_string(line) + ": answer has no '#### N' final answer");
    p.answer = *final_answer;
    p.prompt = p.question + opts.instruction;
    out.push_back(std::move(p));
    return opts.limit == 0 || out.size() < opts.limit;
  });
  return out;
}

using Gsm8kEnv = SingleTurnEnv<MathProblem, rewards::MathAnswerReward>;

inline Gsm8kEnv gsm8k_env(MathProblem problem, rewards::MathAnswerOptions opts = {}) {
  return Gsm8kEnv(std::move(problem), rewards::MathAnswerReward(opts));
}

}  // namespace rlloop::envs
