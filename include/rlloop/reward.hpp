// Rewards: a Score type and the Reward concept.
//
// A reward is any copyable object with a const call operator taking (context, completion text) and returning
// a Score or a plain number. The context is whatever describes the prompt: a MathProblem, a CodeProblem, a
// user struct. The call operator must be const and safe to call from several threads at once: batches are
// scored in parallel (rewards/batch.hpp).
//
//   struct Shorter {
//     double operator()(const MyProblem&, std::string_view completion) const {
//       return completion.size() < 200 ? 1.0 : 0.0;
//     }
//   };
//   static_assert(rlloop::Reward<Shorter, MyProblem>);
//
// Expected outcomes — an unparseable answer, a failing or timed-out test — are data in the Score (status +
// details), never exceptions. Exceptions are for misuse and broken infrastructure only.
#pragma once
#include <concepts>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace rlloop {

// How grading went. `ok` means the completion was graded normally (value says how well it did); the others
// say why it earned what it earned.
enum class ScoreStatus {
  ok,             // graded; value is the reward
  wrong_answer,   // parsed and checked, but not right
  unparseable,    // no answer could be extracted from the completion
  compile_error,  // the program did not compile
  runtime_error,  // the program crashed or exited non-zero
  timeout,        // a test ran out of CPU or wall-clock time
  output_limit,   // a test wrote more output than allowed
  sandbox_error,  // the sandbox could not run the program (infrastructure, reported as data to keep a batch going)
};

constexpr std::string_view to_string(ScoreStatus s) noexcept {
  switch (s) {
    case ScoreStatus::ok:
      return "ok";
    case ScoreStatus::wrong_answer:
      return "wrong_answer";
    case ScoreStatus::unparseable:
      return "unparseable";
    case ScoreStatus::compile_error:
      return "compile_error";
    case ScoreStatus::runtime_error:
      return "runtime_error";
    case ScoreStatus::timeout:
      return "timeout";
    case ScoreStatus::output_limit:
      return "output_limit";
    case ScoreStatus::sandbox_error:
      return "sandbox_error";
  }
  return "unknown";
}

struct Score {
  double value = 0.0;
  ScoreStatus status = ScoreStatus::ok;
  std::string details;  // human-readable: what was extracted, which test failed, ...

  bool ok() const noexcept { return status == ScoreStatus::ok; }
};

namespace detail {
template <class T>
concept score_like = std::convertible_to<T, Score> ||(std::is_arithmetic_v<std::remove_cvref_t<T>>);
}  // namespace detail

// R scores a completion of a prompt described by Ctx.
template <class R, class Ctx>
concept Reward = std::copy_constructible<R> &&
    requires(const R& reward, const Ctx& context, std::string_view completion) {
  { reward(context, completion) } -> detail::score_like;
};

// The Score of one call, whether the reward returns a Score or a number (a number is an `ok` score).
template <class Ctx, Reward<Ctx> R>
Score score_one(const R& reward, const Ctx& context, std::string_view completion) {
  auto&& out = reward(context, completion);
  if constexpr (std::convertible_to<decltype(out), Score>) {
    return Score(std::forward<decltype(out)>(out));
  } else {
    return Score{static_cast<double>(out), ScoreStatus::ok, {}};
  }
}

}  // namespace rlloop
