// The Session concept: the backend behind the clients. A local LibTorch session, a remote HTTP session and
// test fakes all satisfy it; AnySession erases the type when the backend is chosen at run time.
#pragma once
#include <concepts>
#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include <rlloop/future.hpp>
#include <rlloop/loss.hpp>
#include <rlloop/operations.hpp>
#include <rlloop/types.hpp>

namespace rlloop {

// What a training session must provide: every operation of rlloop/operations.hpp that a session runs, each a method
// returning a future (operations run in submission order), and two synchronous queries.
//   forward / forward_backward      built-in loss on a batch (forward computes no gradient)
//   forward_backward_custom         user objective on the per-token logprobs
//   optim_step                      AdamW on the accumulated gradients, then zeroes them
//   save_state / load_state         weights + optimizer (+ step, RNG, gradients pending since the last step)
//                                   checkpoints; load_state without the optimizer starts with none pending
//   save_weights_for_sampler        weights that a sampler can load by the returned path
//   sample / compute_logprobs       rollouts and scoring, optionally from saved sampler weights
template <class S>
concept Session = op::runs_all<S, op::SessionOperations> && requires(S& s) {
  { s.info() } -> std::same_as<SessionInfo>;
  { s.usage() } -> std::same_as<TokenUsage>;
};

// A service creates sessions: the local engine, a remote endpoint, or a fake.
template <class Svc>
concept Service = requires(Svc& svc, const SessionOptions& opts, const std::string& path) {
  typename Svc::session_type;
  requires Session<typename Svc::session_type>;
  { svc.create_session(opts) } -> std::same_as<std::shared_ptr<typename Svc::session_type>>;
  { svc.create_session_from_state(path, opts) } -> std::same_as<std::shared_ptr<typename Svc::session_type>>;
  { svc.open_sampler(path) } -> std::same_as<std::shared_ptr<typename Svc::session_type>>;
  { svc.list_base_models() } -> std::same_as<std::vector<std::string>>;
  { svc.capabilities() } -> std::same_as<ServerCapabilities>;
};

namespace detail {
// One entry of a type-erased session's table: runs Op on the session behind a void pointer.
template <class Op, class P = typename Op::Params>
struct Thunk;
template <class Op, class... A>
struct Thunk<Op, op::Params<A...>> {
  using type = Future<typename Op::Result> (*)(void*, A...);
  template <class S>
  static Future<typename Op::Result> of(void* s, A... a) {
    return Op::call(*static_cast<S*>(s), a...);
  }
};

template <class Op, class... Ops>
constexpr std::size_t index_of() {
  std::size_t i = 0;
  ((std::is_same_v<Op, Ops> ? false : (++i, true)) && ...);
  return i;
}

template <class L>
class ErasedSession;
// A session of any type behind a table with one entry per operation; each descriptor's Method<Self> base gives it
// that operation's named member function.
template <class... Ops>
class ErasedSession<op::List<Ops...>> : public Ops::template Method<ErasedSession<op::List<Ops...>>>... {
 public:
  template <class S>
    requires Session<S>
  explicit ErasedSession(std::shared_ptr<S> s) : session_(std::move(s)), table_(&kTable<S>) {}

  SessionInfo info() { return table_->info(session_.get()); }
  TokenUsage usage() { return table_->usage(session_.get()); }

  // What each Method<Self> calls: runs Op on the session.
  template <class Op, class... A>
  Future<typename Op::Result> run(A&&... a) {
    constexpr std::size_t i = index_of<Op, Ops...>();
    static_assert(i < sizeof...(Ops), "not an operation of this session");
    return std::get<i>(table_->operations)(session_.get(), std::forward<A>(a)...);
  }

 private:
  struct Table {
    std::tuple<typename Thunk<Ops>::type...> operations;
    SessionInfo (*info)(void*);
    TokenUsage (*usage)(void*);
  };
  template <class S>
  static constexpr Table kTable{{&Thunk<Ops>::template of<S>...},
                                [](void* s) { return static_cast<S*>(s)->info(); },
                                [](void* s) { return static_cast<S*>(s)->usage(); }};

  std::shared_ptr<void> session_;
  const Table* table_;
};
}  // namespace detail

// Type-erased session: holds any Session, with one member function per operation (derived from
// rlloop/operations.hpp) and info() / usage().
using AnySession = detail::ErasedSession<op::SessionOperations>;
static_assert(Session<AnySession>);

}  // namespace rlloop
