// safetensors reading/writing, HF model directories (single or sharded), PEFT adapter directories.
#include "io/model_io.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <unistd.h>
#include <atomic>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

#include "io/expert_layout.hpp"
#include "io/gguf_model.hpp"
#include "io/safetensors_header.hpp"

namespace rlloop::engine {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

struct DTypeInfo {
  const char* name;
  torch::ScalarType type;
};
constexpr DTypeInfo kDTypes[] = {
    {"F64", torch::kFloat64}, {"F32", torch::kFloat32}, {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16},
    {"I64", torch::kInt64},   {"I32", torch::kInt32},   {"I16", torch::kInt16},   {"I8", torch::kInt8},
    {"U8", torch::kUInt8},    {"BOOL", torch::kBool},
};

// A dtype parse_safetensors_header accepted (it knows the same names).
torch::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& d : kDTypes)
    if (name == d.name) return d.type;
  throw std::logic_error("read_safetensors: dtype '" + name + "' passed the header's check but has no torch type");
}

const char* dtype_name(torch::ScalarType t, const std::string& tensor) {
  for (const auto& d : kDTypes)
    if (t == d.type) return d.name;
  throw invalid_argument("write_safetensors: tensor '" + tensor +
                         "' has a dtype safetensors cannot store: " + std::string(c10::toString(t)));
}

// Owns a file descriptor; closes it on every path out.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

std::string errno_text() { return std::strerror(errno); }

void write_all(int fd, const char* data, std::size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw io_error("write " + path + ": " + errno_text());
    }
    data += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Writes `path` by streaming into a temporary file beside it, fsync, rename over `path`, fsync the directory:
// readers see the old file or the complete new one, never a torn one, even after a crash.
template <class Writer>
void atomic_write(const std::string& path, Writer&& writer) {
  fs::path target(path);
  fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  // pid + a process-wide counter: sessions of one process (rlloop serve) may write beside each other at once.
  static std::atomic<std::uint64_t> counter{0};
  // Appended, not `"." + name`: GCC 12 warns falsely (-Wstringop-overflow) on operator+(const char*, string&&).
  std::string name = ".";
  name += target.filename().string();
  name += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  const std::string tmp = (dir / name).string();
  {
    Fd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (f.fd < 0) throw io_error("cannot create " + tmp + " (writing " + path + "): " + errno_text());
    try {
      writer(f.fd, tmp);
      if (::fsync(f.fd) != 0) throw io_error("fsync " + tmp + ": " + errno_text());
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw io_error("cannot rename " + tmp + " to " + path + ": " + why);
  }
  Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd >= 0) ::fsync(d.fd);  // best effort: some filesystems refuse fsync on directories
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw io_error("cannot open " + path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

json read_json_file(const std::string& path) {
  try {
    return json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    throw io_error(path + " is not valid JSON: " + e.what());
  }
}

torch::ScalarType storage_dtype(const Transformer& model) {
  auto t = model.hf_state_dict().begin()->second.scalar_type();
  return t == torch::kBFloat16 ? torch::kBFloat16 : torch::kFloat32;
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& content) {
  atomic_write(path, [&](int fd, const std::string& tmp) { write_all(fd, content.data(), content.size(), tmp); });
}

namespace {
// One .safetensors file, open: its checked header, and any one tensor's bytes read on demand.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path)
      : path_(std::move(path)), f_(::open(path_.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (f_.fd < 0) {
      if (errno == ENOENT) throw io_error("read_safetensors: " + path_ + ": no such file");
      throw io_error("read_safetensors: cannot open " + path_ + ": " + errno_text());
    }
    const off_t end = ::lseek(f_.fd, 0, SEEK_END);
    if (end < 0) throw io_error("read_safetensors: cannot seek " + path_ + ": " + errno_text());
    const auto file_size = static_cast<std::uint64_t>(end);
    std::uint64_t header_len = 0;
    if (file_size >= 8) read_at(reinterpret_cast<char*>(&header_len), 8, 0);
    check_safetensors_header_length(header_len, file_size, path_);
    std::string header_text(header_len, '\0');
    read_at(header_text.data(), header_len, 8);
    header_ = parse_safetensors_header(header_text, file_size, path_);
  }
  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return header_.tensors; }
  torch::Tensor read(const SafetensorsEntry& entry) const {
    torch::Tensor t = torch::empty(entry.shape, torch::TensorOptions().dtype(dtype_from_name(entry.dtype)));
    const std::uint64_t nbytes = entry.end - entry.begin;
    if (nbytes > 0) read_at(static_cast<char*>(t.data_ptr()), nbytes, header_.data_start + entry.begin);
    return t;
  }

 private:
  void read_at(char* dst, std::uint64_t n, std::uint64_t offset) const {
    while (n > 0) {
      ssize_t r = ::pread(f_.fd, dst, n, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw io_error("read_safetensors: read " + path_ + ": " + errno_text());
      }
      if (r == 0) throw io_error("read_safetensors: " + path_ + " is truncated (unexpected end of file)");
      dst += r;
      n -= static_cast<std::uint64_t>(r);
      offset += static_cast<std::uint64_t>(r);
    }
  }

  std::string path_;
  Fd f_;
  SafetensorsHeader header_;
};
}  // namespace

TensorMap read_safetensors(const std::string& path) {
  const SafetensorsReader file(path);
  TensorMap out;
  for (const SafetensorsEntry& entry : file.entries()) out.emplace(entry.name, file.read(entry));
  return out;
}

void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> cpu;
  cpu.reserve(tensors.size());
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {  // std::map: sorted names, as the Python writer orders them
    if (!t.defined()) throw invalid_argument("write_safetensors: tensor '" + name + "' is undefined");
    torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    const std::uint64_t nbytes = static_cast<std::uint64_t>(c.numel()) * c.element_size();
    header[name] = {{"dtype", dtype_name(c.scalar_type(), name)},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    cpu.push_back(std::move(c));
  }
  std::string text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned (what the reference implementation does).
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t len = text.size();
  atomic_write(path, [&](int fd, const std::string& tmp) {
    write_all(fd, reinterpret_cast<const char*>(&len), 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const auto& c : cpu)
      write_all(fd, static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel()) * c.element_size(),
                tmp);
  });
}

// ----------------------------------------------------------------------------------------- model dirs

namespace {
// A model directory's tensors: its files open, and each tensor's file and entry by name (a sharded directory's
// index checked against what its files hold).
struct ModelFiles {
  std::vector<std::unique_ptr<SafetensorsReader>> files;
  std::map<std::string, std::pair<const SafetensorsReader*, const SafetensorsEntry*>> tensors;
};

ModelFiles open_model_files(const fs::path& d, const std::string& dir) {
  ModelFiles out;
  auto add = [&](const fs::path& file) -> const SafetensorsReader& {
    out.files.push_back(std::make_unique<SafetensorsReader>(file.string()));
    for (const SafetensorsEntry& entry : out.files.back()->entries())
      out.tensors[entry.name] = {out.files.back().get(), &entry};
    return *out.files.back();
  };
  const fs::path single = d / "model.safetensors";
  const fs::path index = d / "model.safetensors.index.json";
  if (fs::exists(single)) {
    add(single);
    return out;
  }
  if (!fs::exists(index))
    throw not_found("load_model: " + dir + " has neither model.safetensors nor model.safetensors.index.json");
  json idx = read_json_file(index.string());
  if (!idx.contains("weight_map") || !idx["weight_map"].is_object())
    throw io_error("load_model: " + index.string() + " has no weight_map object");
  std::map<std::string, std::string> weight_map;
  std::set<std::string> shards;
  for (auto& [name, file] : idx["weight_map"].items()) {
    if (!file.is_string())
      throw io_error("load_model: " + index.string() + ": weight_map['" + name + "'] is not a file name");
    weight_map[name] = file.get<std::string>();
    shards.insert(file.get<std::string>());
  }
  for (const auto& shard : shards) {
    if (fs::path(shard).has_parent_path())
      throw io_error("load_model: " + index.string() + " names a shard outside the directory: " + shard);
    for (const SafetensorsEntry& entry : add(d / shard).entries()) {
      auto it = weight_map.find(entry.name);
      if (it == weight_map.end() || it->second != shard)
        throw io_error("load_model: shard " + (d / shard).string() + " holds tensor '" + entry.name + "' that " +
                       index.string() + " does not map to it");
    }
  }
  for (const auto& [name, file] : weight_map)
    if (!out.tensors.count(name))
      throw io_error("load_model: tensor '" + name + "' is missing from shard " + (d / file).string());
  return out;
}

ModelConfig model_dir_config(const std::string& dir) {
  const fs::path d(dir);
  if (!fs::is_directory(d)) throw not_found("load_model: model directory " + dir + " does not exist");
  return ModelConfig::load((d / "config.json").string());
}
}  // namespace

std::shared_ptr<Transformer> load_model(const std::string& dir, torch::Device device, torch::ScalarType dtype,
                                        bool keep_quantized) {
  if (is_gguf_path(dir)) return load_gguf_model(dir, device, dtype, keep_quantized);
  const ModelConfig cfg = model_dir_config(dir);
  const ModelFiles files = open_model_files(fs::path(dir), dir);
  TensorMap tensors;
  for (const auto& [name, at] : files.tensors) tensors.emplace(name, at.first->read(*at.second));
  experts_to_model_layout(cfg, tensors);
  auto model = std::make_shared<Transformer>(cfg, torch::TensorOptions().device(device).dtype(dtype));
  model->load_hf_state_dict(tensors);
  return model;
}

namespace {
// A model of `cfg` fully sharded over `group` that is never whole: built on the meta device (frozen for a base),
// each weight made whole by `make`, one at a time in hf_state_dict's order, and only this rank's part kept.
// `weights_hash`, when given, receives a hash of every value made.
std::shared_ptr<Transformer> make_sharded(const ModelConfig& cfg, torch::Device device, torch::ScalarType dtype,
                                          dist::Group& group, std::uint64_t* weights_hash, ShardedUse use,
                                          const Transformer::WeightSource& make) {
  auto model = std::make_shared<Transformer>(cfg, torch::TensorOptions().device(torch::kMeta).dtype(dtype));
  if (use == ShardedUse::frozen_base)
    for (auto& p : model->parameters()) p.set_requires_grad(false);  // its shards then train nothing
  std::uint64_t hash = 0;
  torch::NoGradGuard no_grad;
  model->set_fully_sharded(group, torch::TensorOptions().device(device).dtype(dtype),
                           [&](const std::string& name, const torch::Tensor& shape) {
                             torch::Tensor t = make(name, shape).contiguous();
                             const std::string_view bytes(static_cast<const char*>(t.data_ptr()), t.nbytes());
                             hash = hash * 1000003 ^ std::hash<std::string_view>{}(bytes);
                             return t;
                           });
  if (weights_hash) *weights_hash = hash;
  return model;
}

// make_sharded's model with each weight read from `sources` (of the file `path`). What load_hf_state_dict would
// refuse is refused: a weight the file lacks, and a tensor of the file that no weight takes (RoPE's inv_freq buffer
// and a tied model's stored duplicate of the embedding aside).
std::shared_ptr<Transformer> read_sharded(const ModelConfig& cfg, const std::string& path,
                                          const TensorSources& sources, torch::Device device,
                                          torch::ScalarType dtype, dist::Group& group, std::uint64_t* weights_hash,
                                          ShardedUse use) {
  std::set<std::string> used;
  auto model = make_sharded(cfg, device, dtype, group, weights_hash, use,
                            [&](const std::string& name, const torch::Tensor&) {
                              auto it = sources.find(name);
                              if (it == sources.end())
                                throw io_error("load_model: " + path + " has no tensor '" + name + "'");
                              used.insert(name);
                              return it->second();
                            });
  const WeightNames& names = cfg.family().names;
  for (const auto& [name, read] : sources)
    if (!used.count(name) && !name.ends_with("rotary_emb.inv_freq") &&
        !(cfg.tie_word_embeddings && name == names.lm_head + ".weight"))
      throw invalid_argument("load_hf_state_dict: " + path + " holds tensor '" + name + "', which the model has not");
  return model;
}
}  // namespace

std::shared_ptr<Transformer> load_sharded_model(const std::string& path, torch::Device device,
                                                torch::ScalarType dtype, dist::Group& group,
                                                std::uint64_t* weights_hash, ShardedUse use) {
  const std::string moe = "fully sharded parallelism: Mixture-of-Experts models are not sharded yet";
  if (is_gguf_path(path)) {
    const auto file = gguf::File::open(path);
    const ModelConfig cfg = gguf_model_config(file);
    if (cfg.num_experts > 0) throw unsupported(moe);  // before its expert stacks are asked for
    return read_sharded(cfg, path, gguf_tensor_sources(file, cfg), device, dtype, group, weights_hash, use);
  }
  const ModelConfig cfg = model_dir_config(path);
  if (cfg.num_experts > 0) throw unsupported(moe);
  const ModelFiles files = open_model_files(fs::path(path), path);
  TensorSources sources;
  for (const auto& [name, at] : files.tensors)
    sources.emplace(name, [reader = at.first, entry = at.second] { return reader->read(*entry); });
  return read_sharded(cfg, path, sources, device, dtype, group, weights_hash, use);
}

namespace {
// init_model's value of weight `name` (shaped as `t`), in fp32 on the CPU: a norm's identity, zero biases, and
// N(0, 0.02) drawn from `gen` for matrices and attention sinks (the only draws: the stream depends on them alone).
torch::Tensor initial_weight(const ModelConfig& cfg, const std::string& name, const torch::Tensor& t,
                             at::Generator& gen) {
  const bool bias = name.ends_with(".bias");
  if (t.dim() == 1 && !bias && !name.ends_with("." + cfg.family().names.sinks))  // a norm's, whatever the family
    return torch::full(t.sizes(), cfg.norm_adds_one ? 0.0 : 1.0, torch::kFloat32);
  if (bias) return torch::zeros(t.sizes(), torch::kFloat32);
  return torch::empty(t.sizes(), torch::kFloat32).normal_(0.0, 0.02, gen);
}
}  // namespace

std::shared_ptr<Transformer> init_model(const ModelConfig& cfg, std::int64_t seed, torch::Device device,
                                        torch::ScalarType dtype) {
  auto model = std::make_shared<Transformer>(cfg, torch::TensorOptions().device(device).dtype(dtype));
  // Drawn on the CPU in fp32, in the fixed HF-name order of the model, so a seed gives the same weights on
  // every device and dtype (up to the final cast).
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : model->hf_state_dict()) t.copy_(initial_weight(cfg, name, t, gen));
  return model;
}

std::shared_ptr<Transformer> init_sharded_model(const ModelConfig& cfg, std::int64_t seed, torch::Device device,
                                                torch::ScalarType dtype, dist::Group& group,
                                                std::uint64_t* weights_hash, ShardedUse use) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
  return make_sharded(cfg, device, dtype, group, weights_hash, use,
                      [&](const std::string& name, const torch::Tensor& shape) {
                        return initial_weight(cfg, name, shape, gen);
                      });
}

void save_model(const Transformer& model, const std::string& dir, std::int64_t max_shard_bytes) {
  const fs::path d(dir);
  std::error_code ec;
  fs::create_directories(d, ec);
  if (ec) throw io_error("save_model: cannot create " + dir + ": " + ec.message());

  const auto dtype = storage_dtype(model);
  TensorMap tensors = model.has_lora() ? model.merged_hf_state_dict() : model.hf_state_dict();
  for (auto& [name, t] : tensors) t = t.detach().to(torch::kCPU, dtype);
  experts_to_file_layout(model.config(), tensors);
  ModelConfig cfg = model.config();
  // An lm_head adapter on a tied model makes the merged unembedding differ from the embedding.
  if (cfg.tie_word_embeddings && tensors.count(cfg.family().names.lm_head + ".weight")) cfg.tie_word_embeddings = false;
  json cfg_json = cfg.to_json();
  cfg_json["torch_dtype"] = dtype == torch::kBFloat16 ? "bfloat16" : "float32";
  write_file_atomic((d / "config.json").string(), cfg_json.dump(2) + "\n");

  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  std::int64_t total = 0;
  for (const auto& [name, t] : tensors) total += t.numel() * t.element_size();

  if (max_shard_bytes <= 0 || total <= max_shard_bytes) {
    write_safetensors((d / "model.safetensors").string(), tensors, meta);
    fs::remove(d / "model.safetensors.index.json", ec);  // a stale index would contradict the new file
    return;
  }
  // Greedy packing in name order; a tensor larger than the limit gets a shard of its own.
  std::vector<TensorMap> shards(1);
  std::int64_t current = 0;
  for (const auto& [name, t] : tensors) {
    const std::int64_t bytes = t.numel() * t.element_size();
    if (!shards.back().empty() && current + bytes > max_shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().emplace(name, t);
    current += bytes;
  }
  const std::size_t n = shards.size();
  json weight_map = json::object();
  for (std::size_t i = 0; i < n; ++i) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05zu-of-%05zu.safetensors", i + 1, n);
    write_safetensors((d / file).string(), shards[i], meta);
    for (const auto& [name, t] : shards[i]) weight_map[name] = file;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_file_atomic((d / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  fs::remove(d / "model.safetensors", ec);  // load_model prefers the single file; a stale one would win
}

// ------------------------------------------------------------------------------------------ PEFT dirs

namespace {

// The targets of a model with experts as PEFT writes them for transformers 5's stacked experts: attention (and
// lm_head) in target_modules, the experts' stacked weights and the router's weight in target_parameters, and the
// fused gate_up's doubled rank and alpha in rank_pattern / alpha_pattern (Transformer::peft_state_dict names the
// tensors to match).
void peft_expert_targets(const ModelConfig& config, const LoraOptions& lora, json& cfg) {
  const ModelFamily& family = config.family();
  std::set<std::string> targets(lora.target_modules.begin(), lora.target_modules.end());
  if (targets.erase("all-linear")) {
    for (Projection p : kProjections) targets.insert(family.target_module(p));
    targets.insert(family.router_target_module());
  }
  json modules = json::array(), parameters = json::array();
  for (Projection p : {Projection::q, Projection::k, Projection::v, Projection::o})
    if (targets.count(family.target_module(p))) modules.push_back(family.target_module(p));
  if (targets.count("lm_head")) modules.push_back("lm_head");
  if (targets.count(family.target_module(Projection::gate))) {
    parameters.push_back("gate_up_proj");
    cfg["rank_pattern"] = {{".*\\.gate_up_proj", 2 * lora.rank}};
    cfg["alpha_pattern"] = {{".*\\.gate_up_proj", 2 * lora.alpha}};
  }
  if (targets.count(family.target_module(Projection::down))) parameters.push_back("down_proj");
  if (targets.count(family.router_target_module())) parameters.push_back(family.router_target_module() + ".weight");
  cfg["target_modules"] = modules;
  cfg["target_parameters"] = parameters;
}

}  // namespace

void save_peft_adapter(const Transformer& model, const std::string& dir, const std::string& base_model_name) {
  if (!model.has_lora()) throw conflict("save_peft_adapter: the model has no LoRA adapters");
  const fs::path d(dir);
  std::error_code ec;
  fs::create_directories(d, ec);
  if (ec) throw io_error("save_peft_adapter: cannot create " + dir + ": " + ec.message());
  const LoraOptions& lora = *model.lora_options();
  json cfg = {{"peft_type", "LORA"},      {"task_type", "CAUSAL_LM"}, {"r", lora.rank},
              {"lora_alpha", lora.alpha}, {"lora_dropout", 0.0},      {"bias", "none"},
              {"fan_in_fan_out", false},  {"inference_mode", true},   {"base_model_name_or_path", base_model_name}};
  if (model.config().num_experts > 0) {
    peft_expert_targets(model.config(), lora, cfg);
  } else if (lora.target_modules.size() == 1 && lora.target_modules[0] == "all-linear") {
    cfg["target_modules"] = "all-linear";  // PEFT accepts the literal as a string, and a list of names otherwise
  } else {
    cfg["target_modules"] = lora.target_modules;
  }
  TensorMap tensors = model.peft_state_dict();
  for (auto& [name, t] : tensors) t = t.detach().to(torch::kCPU, torch::kFloat32);
  write_safetensors((d / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomic((d / "adapter_config.json").string(), cfg.dump(2) + "\n");
}

}  // namespace rlloop::engine
