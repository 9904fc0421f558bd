// Futures returned by every session operation. A loop can submit forward_backward and optim_step back to
// back and wait only when it needs a result; errors raised by the operation are rethrown by get().
#pragma once
#include <chrono>
#include <exception>
#include <future>
#include <memory>
#include <utility>

namespace rlloop {

template <class T>
class Future {
 public:
  Future() = default;
  explicit Future(std::shared_future<T> f) : f_(std::move(f)) {}

  // An already-completed future.
  static Future ready(T value) {
    std::promise<T> p;
    p.set_value(std::move(value));
    return Future(p.get_future().share());
  }
  static Future failed(std::exception_ptr e) {
    std::promise<T> p;
    p.set_exception(std::move(e));
    return Future(p.get_future().share());
  }

  // Waits and returns the result, or rethrows the operation's error. The result lives in the future's shared
  // state, so a temporary future returns a copy: `for (auto& s : session.sample(r).get().sequences)` would
  // otherwise walk a response destroyed with the future at the end of the range's expression.
  const T& get() const& { return f_.get(); }
  T get() && { return f_.get(); }
  void wait() const { f_.wait(); }
  bool is_ready() const { return f_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) const {
    return f_.wait_for(d) == std::future_status::ready;
  }
  bool valid() const { return f_.valid(); }

 private:
  std::shared_future<T> f_;
};

// The producing side of a Future.
template <class T>
class Promise {
 public:
  Promise() = default;
  Future<T> future() { return Future<T>(p_.get_future().share()); }
  void set_value(T v) { p_.set_value(std::move(v)); }
  void set_exception(std::exception_ptr e) { p_.set_exception(std::move(e)); }

  // Runs fn and stores its result or its exception.
  template <class Fn>
  void fulfil(Fn&& fn) {
    try {
      p_.set_value(std::forward<Fn>(fn)());
    } catch (...) {
      p_.set_exception(std::current_exception());
    }
  }

 private:
  std::promise<T> p_;
};

}  // namespace rlloop
