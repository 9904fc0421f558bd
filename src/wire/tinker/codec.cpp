#include "wire/tinker/codec.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

#include "tinker_public.pb.h"
#include "wire/loss_config.hpp"
#include "wire/read.hpp"

namespace rlloop::wire::tinker {

namespace {

namespace pb = ::tinker_public;
using nlohmann::json;

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw invalid_argument(path + ": " + what);
}

// A little-endian array of T in `bytes` (the SDK writes numpy's native order; every machine rlloop runs on is
// little-endian).
template <class T>
std::vector<T> array_of(const std::string& bytes, const std::string& path) {
  if (bytes.size() % sizeof(T) != 0)
    bad(path, std::to_string(bytes.size()) + " bytes is not a whole number of " + std::to_string(sizeof(T)) +
                  "-byte values");
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

template <class T>
std::string bytes_of(const std::vector<T>& values) {
  std::string out(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

std::int64_t element_count(const std::vector<std::int64_t>& shape, const std::string& path) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0) bad(path, "shape has a negative dimension");
    if (d != 0 && n > std::numeric_limits<std::int32_t>::max() / d) bad(path, "shape is too large");
    n *= d;
  }
  return n;
}

// The values of a dense or CSR tensor, row-major, as T. A CSR tensor is 2-D; its unlisted cells are 0.
template <class T>
std::vector<T> tensor_values(const pb::Tensor& t, const std::vector<std::int64_t>& shape, const std::string& path) {
  auto decode = [&](const std::string& bytes, const std::string& where) -> std::vector<T> {
    if (t.dtype() == pb::DTYPE_FLOAT32) {
      const auto v = array_of<float>(bytes, where);
      return std::vector<T>(v.begin(), v.end());
    }
    const auto v = array_of<std::int64_t>(bytes, where);
    return std::vector<T>(v.begin(), v.end());
  };
  if (t.has_dense()) return decode(t.dense(), path + ".dense");
  if (!t.has_sparse_csr()) bad(path, "has neither dense nor sparse_csr values");
  if (shape.size() != 2) bad(path, "a sparse_csr tensor must be 2-D, its shape has " + std::to_string(shape.size()));
  const auto values = decode(t.sparse_csr().values(), path + ".sparse_csr.values");
  const auto rows = array_of<std::int64_t>(t.sparse_csr().crow_indices(), path + ".sparse_csr.crow_indices");
  const auto cols = array_of<std::int64_t>(t.sparse_csr().col_indices(), path + ".sparse_csr.col_indices");
  if (static_cast<std::int64_t>(rows.size()) != shape[0] + 1 || rows.front() != 0 ||
      rows.back() != static_cast<std::int64_t>(values.size()) || cols.size() != values.size())
    bad(path, "sparse_csr indices do not describe its values over its shape");
  std::vector<T> dense(static_cast<std::size_t>(shape[0] * shape[1]), T{});
  for (std::int64_t r = 0; r < shape[0]; ++r) {
    if (rows[r + 1] < rows[r]) bad(path, "sparse_csr crow_indices decrease");
    for (std::int64_t i = rows[r]; i < rows[r + 1]; ++i) {
      if (cols[i] < 0 || cols[i] >= shape[1]) bad(path, "sparse_csr column index out of range");
      dense[r * shape[1] + cols[i]] = values[i];
    }
  }
  return dense;
}

// A loss input's values given `shape` (empty: none given, a 1-D tensor), checked to be one value per token:
// rlloop's losses read [T] inputs; a [T, 1] tensor is the same.
TensorData shaped(TensorData out, std::vector<std::int64_t> shape, const std::string& path) {
  const auto n = static_cast<std::int64_t>(out.size());
  if (shape.empty()) shape = {n};
  if (element_count(shape, path) != n)
    bad(path, "holds " + std::to_string(n) + " values, its shape " + json(shape).dump() + " " +
                  std::to_string(element_count(shape, path)));
  if (shape.size() == 2 && shape[1] == 1) shape = {shape[0]};
  if (shape.size() != 1)
    bad(path, "must hold one value per token (shape [T]); rlloop's losses take no [T, K] inputs, got shape " +
                  json(shape).dump());
  out.shape = shape;
  return out;
}

// A protobuf loss input (tinker 0.38): dense or sparse CSR, float32 or int64.
TensorData loss_input(const pb::Tensor& t, const std::string& path) {
  std::vector<std::int64_t> shape(t.shape().begin(), t.shape().end());
  if (t.dtype() != pb::DTYPE_FLOAT32 && t.dtype() != pb::DTYPE_INT64)
    bad(path, "dtype must be float32 or int64, got " + pb::DType_Name(t.dtype()));
  TensorData out;
  if (t.dtype() == pb::DTYPE_FLOAT32) {
    out.dtype = DType::float32;
    out.float_data = tensor_values<float>(t, shape, path);
  } else {
    out.dtype = DType::int64;
    out.int_data = tensor_values<std::int64_t>(t, shape, path);
  }
  return shaped(std::move(out), std::move(shape), path);
}

// Provenance spans (Datum.with_provenance: where each token came from; stable_reinforce reads them, and the
// cookbook attaches them to every datum of sampled tokens, whatever the loss): checked as the SDK states them (each
// names a sequence, no negative offset or length, together they tile their field's `tokens` positions) and kept.
// The SDK's own types allow an empty run (the cookbook's rl_loop makes one of a single sampled token): accepted,
// and left out.
std::vector<ProvenanceSpan> provenance_of(const google::protobuf::RepeatedPtrField<pb::ProvenanceSpan>& spans,
                                          std::size_t tokens, const std::string& path) {
  std::vector<ProvenanceSpan> out;
  std::int64_t covered = 0;
  for (int i = 0; i < spans.size(); ++i) {
    const std::string where = path + "[" + std::to_string(i) + "]";
    const pb::ProvenanceSpan& span = spans[i];
    auto run = [](const auto& r, bool sampled) {
      return ProvenanceSpan{r.sequence_id(), sampled, r.offset(), r.length()};
    };
    if (!span.has_prompt_tokens() && !span.has_sampled_tokens())
      bad(where, "is neither prompt_tokens nor sampled_tokens");
    ProvenanceSpan s = span.has_prompt_tokens() ? run(span.prompt_tokens(), false) : run(span.sampled_tokens(), true);
    if (s.sequence_id.empty()) bad(where, "names no sequence_id");
    if (s.offset < 0 || s.length < 0) bad(where, "has a negative offset or length");
    covered += s.length;
    if (covered > static_cast<std::int64_t>(tokens)) break;  // reported below, before any sum could overflow
    if (s.length > 0) out.push_back(std::move(s));
  }
  if (covered != static_cast<std::int64_t>(tokens))
    bad(path, "covers " + std::to_string(covered) + (covered > static_cast<std::int64_t>(tokens) ? "+" : "") +
                  " positions of " + std::to_string(tokens) + " (provenance spans tile their field)");
  return out;
}

Datum datum_from_proto(const pb::Datum& d, const std::string& path, Provenance& provenance) {
  if ((d.model_input_spans_size() == 0) != (d.loss_fn_input_spans_size() == 0))
    bad(path, "has provenance spans for one of model_input and loss_fn_inputs only (the SDK sets both)");
  Datum out;
  for (int i = 0; i < d.model_input_size(); ++i) {
    const auto& chunk = d.model_input(i);
    const std::string where = path + ".model_input[" + std::to_string(i) + "]";
    if (!chunk.has_encoded_text())
      bad(where, std::string("only encoded_text chunks are supported, not ") +
                     (chunk.has_image() ? "image" : chunk.has_dmel() ? "dmel" : "an empty chunk"));
    const auto tokens = array_of<std::int32_t>(chunk.encoded_text().tokens(), where + ".tokens");
    out.model_input.chunks.push_back(EncodedTextChunk{std::vector<token_id>(tokens.begin(), tokens.end())});
  }
  for (const auto& [name, tensor] : d.loss_fn_inputs())
    out.loss_fn_inputs.emplace(name, loss_input(tensor, path + ".loss_fn_inputs." + name));
  if (d.model_input_spans_size() != 0) {
    provenance.model_input =
        provenance_of(d.model_input_spans(), out.model_input.length(), path + ".model_input_spans");
    const auto targets = out.loss_fn_inputs.find("target_tokens");
    provenance.targets =
        provenance_of(d.loss_fn_input_spans(), targets == out.loss_fn_inputs.end() ? 0 : targets->second.size(),
                      path + ".loss_fn_input_spans");
  }
  return out;
}

// The loss's configuration: loss_fn_config_v2 where the SDK set it (it writes every float there too), else the
// legacy float map. A text value names nothing rlloop's losses read.
std::map<std::string, double> loss_config_of(const pb::ForwardBackwardRequest& r) {
  std::map<std::string, double> config;
  if (!r.loss_fn_config_v2().empty()) {
    for (const auto& [key, value] : r.loss_fn_config_v2()) {
      if (!value.has_number())
        bad("loss_fn_config." + key, "must be a number (" + r.loss_fn() + " takes no text settings)");
      config[key] = value.number();
    }
    return config;
  }
  for (const auto& [key, value] : r.loss_fn_config()) config[key] = value;
  return config;
}

pb::BatchedTensor& field(pb::ArrayRecord& record, const std::string& name, const TensorData& first) {
  auto& f = (*record.mutable_fields())[name];
  f.set_dtype(first.dtype == DType::float32 ? pb::DTYPE_FLOAT32 : pb::DTYPE_INT64);
  return f;
}

}  // namespace

ForwardBackwardCall forward_backward_from_proto(std::string_view bytes) {
  pb::ForwardBackwardRequest r;
  if (!r.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())))
    throw invalid_argument("forward_backward: the body is not a protobuf ForwardBackwardRequest");
  ForwardBackwardCall call;
  call.model_id = r.model_id();
  call.seq_id = r.seq_id();
  call.forward_only = r.forward_only();
  if (r.loss_fn() == "custom")
    bad("loss_fn", "'custom' (a server-side custom loss) is not supported; the SDK's client-side "
                   "forward_backward_custom works (client/config's custom_loss_server_side is false)");
  call.loss = loss_from_config(r.loss_fn(), loss_config_of(r));
  call.provenance.resize(static_cast<std::size_t>(r.data_size()));
  for (int i = 0; i < r.data_size(); ++i)
    call.data.push_back(datum_from_proto(r.data(i), "data[" + std::to_string(i) + "]",
                                         call.provenance[static_cast<std::size_t>(i)]));
  return call;
}

Metrics tinker_metrics(const Metrics& metrics) {
  Metrics out;
  for (const auto& [key, value] : metrics) {
    const auto colon = key.find(':');
    if (colon != std::string::npos && colon > 0 && key.find(':', colon + 1) == std::string::npos &&
        colon + 1 < key.size())
      out.emplace(key, value);
  }
  return out;
}

std::string forward_backward_output_to_proto(const ForwardBackwardOutput& out) {
  pb::ForwardBackwardOutput p;
  p.set_loss_fn_output_type("ArrayRecord");
  for (const auto& [key, value] : tinker_metrics(out.metrics)) (*p.mutable_metrics())[key] = value;
  auto& record = *p.add_loss_fn_outputs();
  record.set_num_datums(static_cast<std::int64_t>(out.loss_fn_outputs.size()));
  if (out.loss_fn_outputs.empty()) return p.SerializeAsString();
  // Every datum's outputs have the same names (the loss's); each field is the datums' values back to back.
  for (const auto& [name, first] : out.loss_fn_outputs.front()) {
    auto& f = field(record, name, first);
    std::vector<std::int64_t> offsets{0};
    std::string data;
    for (std::size_t i = 0; i < out.loss_fn_outputs.size(); ++i) {
      const auto it = out.loss_fn_outputs[i].find(name);
      if (it == out.loss_fn_outputs[i].end() || it->second.dtype != first.dtype)
        throw std::logic_error("forward_backward_output_to_proto: datum " + std::to_string(i) + " lacks " + name);
      data += it->second.dtype == DType::float32 ? bytes_of(it->second.float_data) : bytes_of(it->second.int_data);
      offsets.push_back(static_cast<std::int64_t>(data.size()));
    }
    f.set_data(std::move(data));
    f.set_offsets(bytes_of(offsets));
  }
  return p.SerializeAsString();
}

namespace {

// `stop`: absent = EOS, a string or a list of strings (plus EOS), a list of token ids (plus EOS), [] = none.
void read_stop(const json* stop, std::optional<token_id> eos, SamplingParams& p) {
  p.stop.clear();
  p.stop_token_ids.clear();
  if (!stop) {
    if (eos) p.stop_token_ids.push_back(*eos);
    return;
  }
  const std::string path = "sampling_params.stop";
  if (stop->is_string()) {
    p.stop.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    if (stop->empty()) return;  // the SDK: [] disables every stop, EOS included
    for (std::size_t i = 0; i < stop->size(); ++i) {
      const json& s = (*stop)[i];
      if (s.is_string() && (i == 0 || !p.stop.empty()))
        p.stop.push_back(s.get<std::string>());
      else if (s.is_number_integer() && (i == 0 || !p.stop_token_ids.empty()))
        p.stop_token_ids.push_back(static_cast<token_id>(read::integer(s, read::at(path, i), 0,
                                                                       std::numeric_limits<token_id>::max())));
      else
        read::fail(read::at(path, i), "must be all strings or all token ids");
    }
  } else {
    read::fail(path, "must be a string, a list of strings or a list of token ids");
  }
  if (eos && std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), *eos) == p.stop_token_ids.end())
    p.stop_token_ids.push_back(*eos);
}

SamplingParams sampling_params_of(const json& j, std::optional<token_id> eos) {
  const std::string path = "sampling_params";
  read::object(j, path);
  read::only_keys(j, path, {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"});
  SamplingParams p;
  if (const json* v = read::find(j, "max_tokens"))
    p.max_tokens = static_cast<int>(read::integer(*v, read::join(path, "max_tokens"), 1,
                                                  std::numeric_limits<std::int32_t>::max()));
  if (const json* v = read::find(j, "seed")) p.seed = read::integer(*v, read::join(path, "seed"));
  if (const json* v = read::find(j, "temperature")) p.temperature = read::number(*v, read::join(path, "temperature"));
  if (const json* v = read::find(j, "top_k"))
    p.top_k = static_cast<int>(read::integer(*v, read::join(path, "top_k"), -1, std::numeric_limits<int>::max()));
  if (const json* v = read::find(j, "top_p")) p.top_p = read::number(*v, read::join(path, "top_p"));
  read_stop(read::find(j, "stop"), eos, p);
  return p;
}

// A ModelInput ({"chunks": [{"tokens": [...], "type": "encoded_text"}, ...]}) at `path`.
ModelInput model_input_of(const json& j, const std::string& path) {
  read::object(j, path);
  read::only_keys(j, path, {"chunks"});
  const json& chunks = read::array(read::need(j, path, "chunks"), read::join(path, "chunks"));
  ModelInput in;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const std::string where = read::at(read::join(path, "chunks"), i);
    const json& c = read::object(chunks[i], where);
    const std::string type = c.contains("type") ? read::string(c["type"], read::join(where, "type")) : "encoded_text";
    if (type != "encoded_text")
      read::fail(read::join(where, "type"), "only encoded_text chunks are supported, not " + type);
    read::only_keys(c, where, {"tokens", "type"});
    const json& tokens = read::array(read::need(c, where, "tokens"), read::join(where, "tokens"));
    EncodedTextChunk chunk;
    for (std::size_t k = 0; k < tokens.size(); ++k)
      chunk.tokens.push_back(static_cast<token_id>(read::integer(tokens[k], read::at(read::join(where, "tokens"), k),
                                                                 std::numeric_limits<token_id>::min(),
                                                                 std::numeric_limits<token_id>::max())));
    in.chunks.push_back(std::move(chunk));
  }
  return in;
}

}  // namespace

SampleCall sample_call_from_json(const json& body, std::optional<token_id> eos) {
  read::object(body, "");
  read::only_keys(body, "",
                  {"sampling_session_id", "seq_id", "num_samples", "prompt", "sampling_params", "prompt_logprobs",
                   "topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k", "record_stability_info",
                   "target_prompt_logprobs", "prompt_logprobs_last_n", "base_model", "model_path", "type"});
  SampleCall call;
  call.sampling_session_id = read::string(read::need(body, "", "sampling_session_id"), "sampling_session_id");
  if (const json* v = read::find(body, "seq_id")) call.seq_id = read::integer(*v, "seq_id", 0);
  for (const char* key : {"base_model", "model_path"})
    if (read::find(body, key))
      read::fail(key, "sample by sampling_session_id (create_sampling_session names the weights)");
  for (const char* key : {"topk_sample_logprobs", "prompt_alt_tokens_k"})
    if (const json* v = read::find(body, key); v && read::integer(*v, key) != 0)
      read::fail(key, "is not supported by this server (send 0)");
  if (const json* v = read::find(body, "record_stability_info"))
    call.record_stability_info = read::boolean(*v, "record_stability_info");
  for (const char* key : {"target_prompt_logprobs", "prompt_logprobs_last_n"})
    if (read::find(body, key)) read::fail(key, "is not supported by this server");
  SampleRequest& r = call.request;
  r.prompt = model_input_of(read::need(body, "", "prompt"), "prompt");
  if (const json* v = read::find(body, "num_samples"))
    r.num_samples = static_cast<int>(read::integer(*v, "num_samples", 1, std::numeric_limits<std::int32_t>::max()));
  r.params = sampling_params_of(read::need(body, "", "sampling_params"), eos);
  if (const json* v = read::find(body, "prompt_logprobs"))
    r.include_prompt_logprobs = read::boolean(*v, "prompt_logprobs");
  if (const json* v = read::find(body, "topk_prompt_logprobs"))
    r.topk_prompt_logprobs =
        static_cast<int>(read::integer(*v, "topk_prompt_logprobs", 0, std::numeric_limits<std::int32_t>::max()));
  return call;
}

std::string sample_response_to_proto(const SampleResponse& response) {
  pb::SampleResponse p;
  for (const auto& s : response.sequences) {
    auto& seq = *p.add_sequences();
    seq.set_stop_reason(s.stop_reason == StopReason::stop ? pb::STOP_REASON_STOP : pb::STOP_REASON_LENGTH);
    seq.set_tokens(bytes_of(std::vector<std::int32_t>(s.tokens.begin(), s.tokens.end())));
    seq.set_logprobs(bytes_of(std::vector<float>(s.logprobs.begin(), s.logprobs.end())));
  }
  if (response.prompt_logprobs) {
    std::vector<float> lp(response.prompt_logprobs->begin(), response.prompt_logprobs->end());
    if (!lp.empty()) lp[0] = std::numeric_limits<float>::quiet_NaN();  // the first token has no context
    p.set_prompt_logprobs(bytes_of(lp));
  }
  if (response.topk_prompt_logprobs && !response.topk_prompt_logprobs->empty()) {
    const auto& rows = *response.topk_prompt_logprobs;
    std::size_t k = 0;
    for (const auto& row : rows) k = std::max(k, row.size());
    std::vector<std::int32_t> ids(rows.size() * k, 0);
    std::vector<float> lps(rows.size() * k, -99999.0f);  // the SDK's empty cell
    for (std::size_t i = 0; i < rows.size(); ++i)
      for (std::size_t c = 0; c < rows[i].size(); ++c) {
        ids[i * k + c] = rows[i][c].token;
        lps[i * k + c] = static_cast<float>(rows[i][c].logprob);
      }
    auto& topk = *p.mutable_topk_prompt_logprobs();
    topk.set_token_ids(bytes_of(ids));
    topk.set_logprobs(bytes_of(lps));
    topk.set_k(static_cast<std::uint32_t>(k));
    topk.set_length(static_cast<std::uint32_t>(rows.size()));
  }
  return p.SerializeAsString();
}

// ---- tinker 0.12's JSON generation -------------------------------------------------------------------------------

namespace {

// A TensorData body ({"data": [...], "dtype": "int64" | "float32", "shape": [...] or null}) as a loss input.
TensorData loss_input_of(const json& t, const std::string& path) {
  read::object(t, path);
  read::only_keys(t, path, {"data", "dtype", "shape"});
  const std::string dtype = read::string(read::need(t, path, "dtype"), read::join(path, "dtype"));
  const json& data = read::array(read::need(t, path, "data"), read::join(path, "data"));
  TensorData out;
  for (std::size_t i = 0; i < data.size(); ++i) {
    const std::string where = read::at(read::join(path, "data"), i);
    if (dtype == "float32")
      out.float_data.push_back(static_cast<float>(read::number(data[i], where)));
    else if (dtype == "int64")
      out.int_data.push_back(read::integer(data[i], where));
    else
      bad(read::join(path, "dtype"), "must be float32 or int64, got " + dtype);
  }
  out.dtype = dtype == "float32" ? DType::float32 : DType::int64;
  std::vector<std::int64_t> shape;
  if (const json* v = read::find(t, "shape"); v && !v->is_null()) {
    const json& dims = read::array(*v, read::join(path, "shape"));
    for (std::size_t i = 0; i < dims.size(); ++i)
      shape.push_back(read::integer(dims[i], read::at(read::join(path, "shape"), i), 0));
    if (shape.empty()) bad(read::join(path, "shape"), "is empty (a scalar is no per-token input)");
  }
  return shaped(std::move(out), std::move(shape), path);
}

Datum datum_of(const json& d, const std::string& path) {
  read::object(d, path);
  read::only_keys(d, path, {"model_input", "loss_fn_inputs"});
  Datum out;
  out.model_input = model_input_of(read::need(d, path, "model_input"), read::join(path, "model_input"));
  const std::string inputs = read::join(path, "loss_fn_inputs");
  for (const auto& [name, tensor] : read::object(read::need(d, path, "loss_fn_inputs"), inputs).items())
    out.loss_fn_inputs.emplace(name, loss_input_of(tensor, read::join(inputs, name)));
  return out;
}

json tensor_json(const TensorData& t) {
  json data = t.dtype == DType::float32 ? json(t.float_data) : json(t.int_data);
  return {{"data", std::move(data)},
          {"dtype", t.dtype == DType::float32 ? "float32" : "int64"},
          {"shape", std::vector<std::int64_t>{static_cast<std::int64_t>(t.size())}}};
}

}  // namespace

ForwardBackwardCall forward_backward_from_json(const json& body, bool forward_only) {
  const char* input_key = forward_only ? "forward_input" : "forward_backward_input";
  read::object(body, "");
  read::only_keys(body, "", {input_key, "model_id", "seq_id", "type"});
  ForwardBackwardCall call;
  call.model_id = read::string(read::need(body, "", "model_id"), "model_id");
  if (const json* v = read::find(body, "seq_id"); v && !v->is_null()) call.seq_id = read::integer(*v, "seq_id", 0);
  call.forward_only = forward_only;
  const json& input = read::object(read::need(body, "", input_key), input_key);
  read::only_keys(input, input_key, {"data", "loss_fn", "loss_fn_config"});
  const std::string loss = read::string(read::need(input, input_key, "loss_fn"), read::join(input_key, "loss_fn"));
  if (loss == "custom")
    bad(read::join(input_key, "loss_fn"), "'custom' (a server-side custom loss) is not supported; the SDK's "
                                          "client-side forward_backward_custom works");
  std::map<std::string, double> config;
  if (const json* c = read::find(input, "loss_fn_config"); c && !c->is_null())
    for (const auto& [key, value] : read::object(*c, read::join(input_key, "loss_fn_config")).items())
      config[key] = read::number(value, read::join(read::join(input_key, "loss_fn_config"), key));
  call.loss = loss_from_config(loss, config);
  const json& data = read::array(read::need(input, input_key, "data"), read::join(input_key, "data"));
  for (std::size_t i = 0; i < data.size(); ++i) call.data.push_back(datum_of(data[i], read::at("data", i)));
  call.provenance.resize(call.data.size());  // tinker 0.12's datums carry none
  return call;
}

json forward_backward_output_to_json(const ForwardBackwardOutput& out) {
  json outputs = json::array();
  for (const auto& datum : out.loss_fn_outputs) {
    json fields = json::object();
    for (const auto& [name, t] : datum) fields[name] = tensor_json(t);
    outputs.push_back(std::move(fields));
  }
  return {{"loss_fn_output_type", "ArrayRecord"},
          {"loss_fn_outputs", std::move(outputs)},
          {"metrics", tinker_metrics(out.metrics)}};
}

json sample_response_to_json(const SampleResponse& response) {
  json sequences = json::array();
  for (const auto& s : response.sequences)
    sequences.push_back({{"stop_reason", s.stop_reason == StopReason::stop ? "stop" : "length"},
                         {"tokens", s.tokens},
                         {"logprobs", s.logprobs}});
  json out = {{"sequences", std::move(sequences)}, {"type", "sample"}};
  if (response.prompt_logprobs) {
    json lp(*response.prompt_logprobs);
    if (!lp.empty()) lp[0] = nullptr;  // the first token has no context
    out["prompt_logprobs"] = std::move(lp);
  }
  if (response.topk_prompt_logprobs) {
    json rows = json::array();
    for (const auto& row : *response.topk_prompt_logprobs) {
      json cells = json::array();
      for (const auto& c : row) cells.push_back({c.token, c.logprob});
      rows.push_back(std::move(cells));
    }
    if (!rows.empty()) rows[0] = nullptr;
    out["topk_prompt_logprobs"] = std::move(rows);
  }
  return out;
}

AdamParams adam_params_from_json(const json& j, const std::string& path) {
  read::object(j, path);
  read::only_keys(j, path, {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "type"});
  AdamParams a;
  auto number = [&](const char* key, double& into) {
    if (const json* v = read::find(j, key)) into = read::number(*v, read::join(path, key));
  };
  number("learning_rate", a.learning_rate);
  number("beta1", a.beta1);
  number("beta2", a.beta2);
  number("eps", a.eps);
  number("weight_decay", a.weight_decay);
  double clip = 0;
  number("grad_clip_norm", clip);
  if (clip > 0) a.grad_clip_norm = clip;
  return a;
}

}  // namespace rlloop::wire::tinker
