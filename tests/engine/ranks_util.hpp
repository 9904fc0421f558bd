// Ranks of a group as threads of a test process: rank 0 on the calling thread, the others on threads of their own.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/group.hpp"

namespace test_util {

namespace dist = rlloop::engine::dist;

// Runs `body(rank, group)` on W ranks of a group made with `base` (its rank, world size and port set here); the
// error each rank threw, by rank ("" for none).
inline std::vector<std::string> on_ranks(int W, const std::function<void(int, dist::Group&)>& body,
                                         dist::GroupOptions base = {}) {
  std::vector<std::string> errors(W);
  base.world_size = W;
  base.rank = 0;
  std::unique_ptr<dist::Group> group0 = dist::Group::listen(base);
  auto rank = [&](int r) {
    try {
      std::unique_ptr<dist::Group> own;
      dist::Group* g = group0.get();
      if (r == 0) {
        g->wait_for_ranks();
      } else {
        dist::GroupOptions o = base;
        o.rank = r;
        o.port = group0->port();
        own = dist::Group::join(o);
        g = own.get();
      }
      body(r, *g);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::vector<std::thread> others;
  for (int r = 1; r < W; ++r) others.emplace_back(rank, r);
  rank(0);
  for (auto& t : others) t.join();
  return errors;
}

}  // namespace test_util
