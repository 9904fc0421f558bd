// rlloop::tokenizer: the byte tokenizer round-trips text.
#include <cstdio>

#include <rlloop/tokenizer.hpp>

int main() {
  const auto tok = rlloop::load_tokenizer("byte");
  const auto ids = tok->encode("hi", false);
  std::printf("tokenizer: %zu ids, '%s'\n", ids.size(), tok->decode(ids, false).c_str());
  return ids.size() == 2 && tok->decode(ids, false) == "hi" ? 0 : 1;
}
