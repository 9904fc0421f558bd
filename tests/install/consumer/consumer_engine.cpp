// rlloop::engine: the process configured, a local service lists its built-in models (the header includes no
// LibTorch; linking does).
#include <algorithm>
#include <cstdio>

#include <rlloop/local.hpp>

int main() {
  if (rlloop::configure_engine_process({.num_threads = 1}).num_threads != 1) return 1;
  rlloop::LocalService service;
  const auto models = service.list_base_models();
  const bool tiny = std::find(models.begin(), models.end(), "rlloop-tiny") != models.end();
  std::printf("engine: %zu base models, rlloop-tiny %s\n", models.size(), tiny ? "listed" : "missing");
  return tiny ? 0 : 1;
}
