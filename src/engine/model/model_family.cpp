#include "model/model_family.hpp"

#include <deque>
#include <mutex>
#include <set>

#include <rlloop/error.hpp>

#include "model/families/families.hpp"

namespace rlloop::engine {
namespace {

// The families compiled in, one line each (their files are in families/).
std::vector<ModelFamily> builtin_families() {
  return {families::llama(),   families::qwen2(),   families::qwen3(),  families::qwen3_moe(),
          families::gpt_oss(), families::mistral(), families::gemma2()};
}

// A deque keeps every entry at its address while later ones are added: find_model_family's pointers stay valid.
struct Registry {
  std::mutex mu;
  std::deque<ModelFamily> families;
};

void check_family(const ModelFamily& f, const std::deque<ModelFamily>& registered) {
  std::string what = "register_model_family('";
  what += f.model_type;
  what += "'): ";
  if (f.model_type.empty()) throw invalid_argument("register_model_family: model_type is empty");
  for (const ModelFamily& other : registered) {
    if (other.model_type == f.model_type) throw invalid_argument(what + "the model_type is registered already");
    if (!f.gguf_architecture.empty() && other.gguf_architecture == f.gguf_architecture)
      throw invalid_argument(what + "GGUF architecture '" + f.gguf_architecture + "' is " + other.model_type + "'s");
  }
  if (f.hf_architecture.empty()) throw invalid_argument(what + "hf_architecture is empty");
  if (f.chat_renderer.empty()) throw invalid_argument(what + "chat_renderer is empty");
  const WeightNames& n = f.names;
  if (n.embed.empty() || n.final_norm.empty() || n.lm_head.empty() || n.layer_prefix.empty())
    throw invalid_argument(what + "a tensor name is empty");
  // Within a layer every tensor has a name of its own (two roles under one name would alias one tensor).
  std::set<std::string> in_layer;
  std::vector<const std::string*> layer_names = {&n.input_norm, &n.post_norm, &n.q_norm, &n.k_norm, &n.router,
                                                 &n.experts};
  if (f.sandwich_norms) layer_names.insert(layer_names.end(), {&n.attn_out_norm, &n.mlp_out_norm});
  for (const std::string* name : layer_names)
    if (name->empty() || !in_layer.insert(*name).second)
      throw invalid_argument(what + "layer tensor name '" + *name + "' is empty or used twice");
  std::set<std::string> targets;
  for (Projection p : kProjections) {
    const std::string& path = n.projections[static_cast<std::size_t>(p)];
    if (path.empty() || path.back() == '.' || !in_layer.insert(path).second)
      throw invalid_argument(what + "projection path '" + path + "' is empty, ends in '.' or is used twice");
    const std::string t = f.target_module(p);
    if (t == "lm_head" || t == "all-linear" || !targets.insert(t).second)
      throw invalid_argument(what + "projection module '" + t +
                             "' is used twice or reserved (lm_head, all-linear)");
  }
  if (f.experts) {  // the router is a LoRA target of its own
    const std::string r = f.router_target_module();
    if (r.empty() || r == "lm_head" || r == "all-linear" || targets.count(r))
      throw invalid_argument(what + "router module '" + r + "' is empty, a projection's or reserved");
  }
}

Registry& registry() {
  static Registry* r = [] {
    auto* fresh = new Registry;  // never destroyed: families outlive every static that may still read them
    for (ModelFamily& f : builtin_families()) {
      check_family(f, fresh->families);
      fresh->families.push_back(std::move(f));
    }
    return fresh;
  }();
  return *r;
}

}  // namespace

std::string ModelFamily::projection_module(std::int64_t layer, Projection p) const {
  return layer_tensor(layer, names.projections[static_cast<std::size_t>(p)]);
}

std::string ModelFamily::expert_module(std::int64_t layer, std::int64_t expert, Projection p) const {
  return layer_tensor(layer, names.experts + "." + std::to_string(expert) + "." + target_module(p));
}

std::string ModelFamily::layer_tensor(std::int64_t layer, const std::string& name) const {
  std::string out = names.layer_prefix;
  out += std::to_string(layer);
  out += '.';
  out += name;
  return out;
}

std::string ModelFamily::target_module(Projection p) const {
  const std::string& path = names.projections[static_cast<std::size_t>(p)];
  return path.substr(path.rfind('.') + 1);  // npos + 1 == 0: a path without a dot is its own name
}

std::string ModelFamily::router_target_module() const { return names.router.substr(names.router.rfind('.') + 1); }

std::vector<std::string> ModelFamily::lora_target_modules() const {
  std::vector<std::string> out;
  for (Projection p : kProjections) out.push_back(target_module(p));
  if (experts) out.push_back(router_target_module());
  out.push_back("lm_head");
  out.push_back("all-linear");
  return out;
}

std::vector<const ModelFamily*> model_families() {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  std::vector<const ModelFamily*> out;
  for (const ModelFamily& f : r.families) out.push_back(&f);
  return out;
}

const ModelFamily* find_model_family(const std::string& model_type) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  for (const ModelFamily& f : r.families)
    if (f.model_type == model_type) return &f;
  return nullptr;
}

const ModelFamily* find_gguf_family(const std::string& architecture) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  for (const ModelFamily& f : r.families)
    if (!f.gguf_architecture.empty() && f.gguf_architecture == architecture) return &f;
  return nullptr;
}

std::string supported_model_types() {
  std::string out;
  for (const ModelFamily* f : model_families()) {
    if (!out.empty()) out += ", ";
    out += f->model_type;
  }
  return out;
}

const ModelFamily& register_model_family(ModelFamily family) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  check_family(family, r.families);
  r.families.push_back(std::move(family));
  return r.families.back();
}

}  // namespace rlloop::engine
