// The built-in model families, one file each (model_family.hpp). builtin_families() in model_family.cpp lists them.
#pragma once
#include "model/model_family.hpp"

namespace rlloop::engine::families {

ModelFamily llama();
ModelFamily mistral();
ModelFamily qwen2();
ModelFamily qwen3();
ModelFamily qwen3_moe();
ModelFamily gpt_oss();
ModelFamily gemma2();

}  // namespace rlloop::engine::families
