#include "io/checkpoint.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <rlloop/error.hpp>

#include "io/model_io.hpp"

namespace rlloop::engine {
namespace fs = std::filesystem;
namespace {

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) throw io_error("cannot open '" + p.string() + "' to fsync: " + std::strerror(errno));
  ::fsync(fd);
  ::close(fd);
}

std::string unique_suffix() {
  static std::atomic<unsigned> counter{0};
  return std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw not_found("cannot read '" + p.string() + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

nlohmann::json checkpoint_meta_to_json(const CheckpointMeta& meta) {
  // The LoRA settings under the runtime wire's keys (LoraOptions there is {rank, alpha, targetModules}).
  nlohmann::json lora = nullptr;
  if (meta.lora)
    lora = {{"rank", meta.lora->rank}, {"alpha", meta.lora->alpha}, {"targetModules", meta.lora->target_modules}};
  return {{"format", kCheckpointFormat},
          {"base_model", meta.base_model},
          {"lora", lora},
          {"value_head", meta.value_head},
          {"seed", meta.seed},
          {"step", meta.step},
          {"rng_state", meta.rng_state},
          {"has_optimizer", meta.has_optimizer},
          {"has_gradients", meta.has_gradients},
          // Read by nothing here; written since the format's first version, so kept for whoever reads it.
          {"for_sampler", !meta.has_optimizer}};
}

CheckpointMeta checkpoint_meta_from_json(const nlohmann::json& j, const std::string& path) {
  if (!j.is_object() || j.value("format", "") != kCheckpointFormat)
    throw io_error("'" + path + "' is not an rlloop checkpoint: state.json's format is not " + kCheckpointFormat);
  std::string key;  // the one being read, for the message
  auto at = [&](const char* k) -> const nlohmann::json& {
    key = k;
    if (!j.contains(k)) throw io_error("checkpoint '" + path + "': state.json lacks \"" + key + "\"");
    return j.at(k);
  };
  // Flags a checkpoint may leave out (value_head: saved before sessions had value heads), false when absent.
  auto flag = [&](const char* k) {
    key = k;
    return j.value(k, false);
  };
  try {
    CheckpointMeta m;
    m.base_model = at("base_model").get<std::string>();
    if (const auto& lora = at("lora"); !lora.is_null()) {
      // "target_modules": as checkpoints spelled it before they took the wire's keys.
      const char* modules = lora.contains("targetModules") ? "targetModules" : "target_modules";
      m.lora = LoraOptions{lora.at("rank").get<int>(), lora.at("alpha").get<int>(),
                           lora.at(modules).get<std::vector<std::string>>()};
    }
    m.value_head = flag("value_head");
    m.seed = at("seed").get<std::int64_t>();
    m.step = at("step").get<std::int64_t>();
    m.rng_state = at("rng_state").get<std::vector<std::uint8_t>>();
    m.has_optimizer = flag("has_optimizer");
    m.has_gradients = flag("has_gradients");
    return m;
  } catch (const nlohmann::json::exception& e) {
    throw io_error("checkpoint '" + path + "': state.json's \"" + key + "\" is malformed: " + e.what());
  }
}

void write_state_dir(const std::string& dir, const TensorMap& weights, const TensorMap* optimizer,
                     CheckpointMeta meta, const TensorMap* gradients) {
  const fs::path target = fs::absolute(fs::path(dir)).lexically_normal();
  const fs::path parent = target.parent_path();
  fs::create_directories(parent);
  // A process killed mid-save leaves its temporary directory behind; it was never visible as a checkpoint.
  // Appended, not `"." + name`: GCC 12 warns falsely (-Wstringop-overflow) on operator+(const char*, string&&).
  std::string tmp_prefix = ".";
  tmp_prefix += target.filename().string();
  tmp_prefix += ".tmp-";
  for (const auto& entry : fs::directory_iterator(parent))
    if (entry.path().filename().string().rfind(tmp_prefix, 0) == 0) fs::remove_all(entry.path());
  const fs::path tmp = parent / (tmp_prefix + unique_suffix());
  fs::create_directories(tmp);
  write_safetensors((tmp / "weights.safetensors").string(), weights);
  if (optimizer) write_safetensors((tmp / "optimizer.safetensors").string(), *optimizer);
  if (gradients) write_safetensors((tmp / "gradients.safetensors").string(), *gradients);
  meta.has_optimizer = optimizer != nullptr;
  meta.has_gradients = gradients != nullptr;
  write_file_atomic((tmp / "state.json").string(), checkpoint_meta_to_json(meta).dump(2));
  fsync_path(tmp);

  if (fs::exists(target)) {
    // Swap old and new in one step, then delete the old one: there is no moment without a complete `target`.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0)
      throw io_error("cannot replace checkpoint '" + target.string() + "': " + std::strerror(errno));
    fs::remove_all(tmp);
  } else if (::rename(tmp.c_str(), target.c_str()) != 0) {
    throw io_error("cannot move checkpoint into '" + target.string() + "': " + std::strerror(errno));
  }
  fsync_path(parent);
}

CheckpointMeta read_checkpoint_meta(const std::string& path) {
  const fs::path dir(path);
  if (!fs::exists(dir)) throw not_found("checkpoint '" + path + "' does not exist");
  if (!fs::exists(dir / "state.json")) throw io_error("'" + path + "' is not a checkpoint: state.json is missing");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(read_text(dir / "state.json"));
  } catch (const nlohmann::json::exception& e) {
    throw io_error("checkpoint '" + path + "': state.json is malformed: " + e.what());
  }
  return checkpoint_meta_from_json(meta, path);
}

StateContents read_state_dir(const std::string& path, bool with_optimizer) {
  const fs::path dir(path);
  StateContents out;
  out.meta = read_checkpoint_meta(path);
  out.weights = read_safetensors((dir / "weights.safetensors").string());
  if (with_optimizer) {
    if (!out.meta.has_optimizer)
      throw invalid_argument("checkpoint '" + dir.string() + "' holds no optimizer state (saved for sampling only)");
    out.optimizer = read_safetensors((dir / "optimizer.safetensors").string());
    if (out.meta.has_gradients) out.gradients = read_safetensors((dir / "gradients.safetensors").string());
  }
  return out;
}

}  // namespace rlloop::engine
