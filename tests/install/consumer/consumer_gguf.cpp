// rlloop::gguf: a Q8_0 block dequantizes to its scale times its values.
#include <cstdint>
#include <cstdio>
#include <vector>

#include <rlloop/gguf.hpp>

int main() {
  std::vector<std::uint8_t> block{0x00, 0x38};  // d = 0.5 as an IEEE half
  for (int i = 0; i < 32; ++i) block.push_back(static_cast<std::uint8_t>(i));
  std::vector<float> values(32);
  rlloop::gguf::dequantize(rlloop::gguf::TensorType::q8_0, block, values);
  std::printf("gguf: Q8_0 value 31 = %g\n", values[31]);
  return values[31] == 15.5f ? 0 : 1;
}
