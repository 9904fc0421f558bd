// The rlloop error hierarchy. Misuse and infrastructure failures throw; expected outcomes (an unparseable
// answer, a test that times out) are data in a Score, never exceptions.
#pragma once
#include <stdexcept>
#include <string>

namespace rlloop {

// Base of everything rlloop throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller passed something invalid (wrong shape, unknown loss, id out of range, ...).
// Maps to ValidationException / HTTP 400 on the wire.
class invalid_argument : public error {
 public:
  using error::error;
};

// A named thing (session, checkpoint, operation, file) does not exist. ResourceNotFoundException / 404.
class not_found : public error {
 public:
  using error::error;
};

// The object is in a state that cannot accept the call. ConflictException / 409.
class conflict : public error {
 public:
  using error::error;
};

// Reading or writing files, checkpoints, sockets failed, or stored data is corrupt.
class io_error : public error {
 public:
  using error::error;
};

// A rank of a data-parallel group died or stopped answering, so the group cannot go on: the operation that
// met it failed, and every later one on that group fails the same way until the group is formed again.
class group_failure : public io_error {
 public:
  using io_error::io_error;
};

// A feature that this build or backend does not provide.
class unsupported : public error {
 public:
  using error::error;
};

// An error that carries an AWS-style error name and the HTTP status it maps to.
class coded_error : public error {
 public:
  coded_error(std::string code, int http_status, const std::string& message)
      : error(code + ": " + message), code_(std::move(code)), http_status_(http_status) {}
  const std::string& code() const noexcept { return code_; }
  int http_status() const noexcept { return http_status_; }

 private:
  std::string code_;
  int http_status_;
};

// An error returned by a remote service.
class remote_error : public coded_error {
 public:
  using coded_error::coded_error;
};

}  // namespace rlloop
