// What data parallelism costs: SFT steps (forward_backward + optim_step) of one rlloop-100m session on one rank
// and on two (this process and an `rlloop worker` it starts, c10d Gloo over the loopback), for LoRA rank 16 on all
// linear layers and for full fine-tuning. Prints, per case, the median step time and its two halves, and for W=2
// the all-reduce seconds and bytes per step (LocalService::data_parallel_stats, differences around each timed
// step) and the step-time ratios against W=1; full fine-tuning runs a fourth case, W=2 fully sharded (--shard full:
// each rank keeps half of the weights, gradients and moments), with the bytes its all-gathers received and its
// reduce-scatters sent per step against the model's size, and a fifth, the same with RLLOOP_SHARD_PREFETCH=0 (each
// layer gathered where it runs instead of a layer ahead), for what prefetch gains. A third mode, "sample", times one sample call of the LoRA session
// instead (S samples of up to M new tokens, seeded, temperature 1): at W=2 each rank decodes half the samples.
//   data_parallel_bench [--rlloop PATH] [--rounds R] [--steps N] [--batch B] [--tokens T] [--samples S]
//                       [--max-tokens M] [--only lora|full|sample]
// Cases, each run in a fresh child process of this program (so that each gets the LibTorch thread count it asks
// for and starts from an empty allocator cache):
//   W=1, 2 threads   the whole machine to one rank: what W=2 competes with on a 2-core machine
//   W=1, 1 thread    one rank's share of the cores, for reference
//   W=2, 1 thread    per rank (the workers take the parent's thread count)
// A shared machine's load moves step times by more than the differences measured, so the cases alternate: R
// rounds, each running every case of a mode once (in a rotated order) for one warm-up step and N timed steps;
// the figures are medians over the R x N timed steps of a case. The batch is B datums of T tokens (pseudo-random
// byte ids, every target weighted 1), the same every step; equal lengths make the token-count split across two
// ranks exactly even. Also printed: each rank's CPU seconds per step (getrusage for rank 0, /proc for the local
// worker), which a loaded machine changes less than the wall time, and which show how evenly the split loads ranks.
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <rlloop/local.hpp>

#include "synthetic_tokens.hpp"

extern char** environ;

namespace {

using namespace rlloop;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

struct Settings {
  std::string rlloop_bin = RLLOOP_BIN;
  int rounds = 3;
  int steps = 2;  // timed steps per round
  int batch = 8;
  int tokens = 128;
  int samples = 8;      // sample mode: samples per call
  int max_tokens = 64;  // and new tokens per sample at most
  std::string only;     // "lora", "full" or "sample": run one mode only
};

struct Case {
  std::string mode;  // "lora", "full", "sharded" (full fine-tuning, fully sharded), "sharded-serial" or "sample"
  int world_size;
  int threads;  // per rank
  bool sharded() const { return mode == "sharded" || mode == "sharded-serial"; }
};

struct Step {
  double forward_backward_s = 0, optim_s = 0;
  double allreduce_calls = 0, allreduce_bytes = 0, allreduce_s = 0;  // data_parallel_stats around the step
  // CPU seconds the step took on rank 0 (this process, all its threads) and on the local workers: the work done,
  // which the machine's load changes far less than the wall time, and how it is split between the ranks.
  double cpu_rank0_s = 0, cpu_workers_s = 0;
  double sampled_tokens = 0, worker_samples = 0;  // sample mode: new tokens of the call, samples the worker decoded
  double allgather_bytes = 0, reduce_scatter_bytes = 0, reduce_scatter_sent_bytes = 0;  // fully sharded
};

// What a child reports for its case on stdout: one "case" line, then one "step" line per timed step.
struct Run {
  double open_s = 0;  // create_session, including the broadcast of the trainable weights for W=2
  std::int64_t trainable = 0;
  double broadcast_bytes = 0;
  double rss_rank0_mib = 0, rss_worker_mib = 0;  // resident memory after the last step (VmRSS)
  std::vector<Step> steps;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::vector<rlloop::token_id> tokens(int n, std::uint32_t seed) { return rlloop::bench::synthetic_tokens(n, seed); }

std::vector<Datum> sft_batch(int batch, int length) {
  std::vector<Datum> data;
  for (int i = 0; i < batch; ++i) {
    auto seq = tokens(length + 1, 7 + i);
    std::vector<token_id> input(seq.begin(), seq.end() - 1), target(seq.begin() + 1, seq.end());
    data.push_back({ModelInput::from_tokens(input),
                    {{"target_tokens", TensorData::from_tokens(target)},
                     {"weights", TensorData::from_floats(std::vector<float>(length, 1.0f))}}});
  }
  return data;
}

double cpu_seconds_self() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// This process's children: the local workers.
std::vector<long> child_pids() {
  std::vector<long> pids;
  for (const auto& task : fs::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "children");
    for (long pid; in >> pid;) pids.push_back(pid);
  }
  return pids;
}

// User + system CPU seconds of this process's children (the local workers; none for W=1), from /proc.
double cpu_seconds_children() {
  double ticks = 0;
  for (long pid : child_pids()) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 1));
    std::string field;
    // After "pid (comm)": state is field 3; utime and stime are fields 14 and 15.
    for (int i = 3; i <= 13 && fields >> field; ++i) {
    }
    double utime = 0, stime = 0;
    if (fields >> utime >> stime) ticks += utime + stime;
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The resident memory (VmRSS) of process `pid` ("self" for this one) in MiB, 0 when unreadable.
double resident_mib(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  return 0;
}

// The child's side: one service, one session, a warm-up step, the timed steps.
Run run_case(const Settings& settings, const Case& c) {
  const auto in_effect = configure_engine_process({.num_threads = c.threads});
  if (in_effect.num_threads != c.threads) throw std::runtime_error("thread count not applied");
  const fs::path dir = fs::temp_directory_path() / ("rlloop-dp-bench-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  Run run;
  {
    LocalServiceOptions options;
    options.checkpoint_dir = dir.string();
    options.device = "cpu";
    options.data_parallel.world_size = c.world_size;
    options.data_parallel.worker_program = settings.rlloop_bin;
    // A full fine-tuning step of rlloop-100m takes many seconds here; a loaded machine must not look like a hung rank.
    options.data_parallel.timeout_s = 600;
    if (c.sharded()) options.data_parallel.shard = "full";
    // Each layer's all-gather issued where the layer runs, not a layer ahead (the workers inherit it).
    if (c.mode == "sharded-serial") ::setenv("RLLOOP_SHARD_PREFETCH", "0", 1);
    LocalService svc(options);
    SessionOptions session{.base_model = "rlloop-100m", .seed = 1};
    if (c.mode != "full" && !c.sharded()) session.lora = LoraOptions{.rank = 16, .alpha = 32, .target_modules = {"all-linear"}};
    const auto t0 = Clock::now();
    auto s = svc.create_session(session);
    run.open_s = seconds_since(t0);
    run.trainable = s->info().num_trainable_parameters;

    const auto data = sft_batch(settings.batch, settings.tokens);
    const auto loss = LossSpec::cross_entropy();
    const AdamParams adam{.learning_rate = 1e-5};
    SampleRequest request;
    request.prompt = ModelInput::from_tokens(tokens(32, 3));
    request.num_samples = settings.samples;
    request.params.max_tokens = settings.max_tokens;
    request.params.seed = 5;
    auto step = [&] {
      Step st;
      const DataParallelStats before = svc.data_parallel_stats();
      const double cpu0 = cpu_seconds_self(), cpu1 = cpu_seconds_children();
      auto t = Clock::now();
      if (c.mode == "sample") {
        for (const auto& seq : s->sample(request).get().sequences)
          st.sampled_tokens += static_cast<double>(seq.decode_tokens);
        st.forward_backward_s = seconds_since(t);  // the sample call's time, in the step's first half
      } else {
        s->forward_backward(data, loss).get();
        st.forward_backward_s = seconds_since(t);
        t = Clock::now();
        s->optim_step(adam).get();
        st.optim_s = seconds_since(t);
      }
      st.cpu_rank0_s = cpu_seconds_self() - cpu0;
      st.cpu_workers_s = cpu_seconds_children() - cpu1;
      const DataParallelStats after = svc.data_parallel_stats();
      st.allreduce_calls = static_cast<double>(after.allreduce_calls - before.allreduce_calls);
      st.allreduce_bytes = static_cast<double>(after.allreduce_bytes - before.allreduce_bytes);
      st.allreduce_s = after.allreduce_seconds - before.allreduce_seconds;
      st.worker_samples = static_cast<double>(after.worker_samples - before.worker_samples);
      st.allgather_bytes = static_cast<double>(after.allgather_bytes - before.allgather_bytes);
      st.reduce_scatter_bytes = static_cast<double>(after.reduce_scatter_bytes - before.reduce_scatter_bytes);
      st.reduce_scatter_sent_bytes =
          static_cast<double>(after.reduce_scatter_sent_bytes - before.reduce_scatter_sent_bytes);
      std::fprintf(stderr, "  [%s W=%d threads=%d] %.2f + %.2f s (all-reduce %.3f s; CPU %.2f + %.2f s)\n",
                   c.mode.c_str(), c.world_size, c.threads, st.forward_backward_s, st.optim_s, st.allreduce_s,
                   st.cpu_rank0_s, st.cpu_workers_s);
      return st;
    };
    step();  // warm-up: gradient buffers, optimizer moments, the allocator's cache
    for (int i = 0; i < settings.steps; ++i) run.steps.push_back(step());
    run.broadcast_bytes = static_cast<double>(svc.data_parallel_stats().broadcast_bytes);
    run.rss_rank0_mib = resident_mib("self");
    for (long pid : child_pids()) run.rss_worker_mib += resident_mib(std::to_string(pid));
  }
  fs::remove_all(dir);
  return run;
}

std::string encode(const Run& r) {
  std::ostringstream out;
  out.precision(17);
  out << "case " << r.open_s << ' ' << r.trainable << ' ' << r.broadcast_bytes << ' ' << r.rss_rank0_mib << ' '
      << r.rss_worker_mib << '\n';
  for (const Step& s : r.steps)
    out << "step " << s.forward_backward_s << ' ' << s.optim_s << ' ' << s.allreduce_calls << ' ' << s.allreduce_bytes
        << ' ' << s.allreduce_s << ' ' << s.cpu_rank0_s << ' ' << s.cpu_workers_s << ' ' << s.sampled_tokens << ' '
        << s.worker_samples << ' ' << s.allgather_bytes << ' ' << s.reduce_scatter_bytes << ' '
        << s.reduce_scatter_sent_bytes << '\n';
  return out.str();
}

bool decode(const std::string& text, Run& r) {
  const auto at = text.find("case ");
  if (at == std::string::npos) return false;
  std::istringstream in(text.substr(at));
  std::string tag;
  if (!(in >> tag >> r.open_s >> r.trainable >> r.broadcast_bytes >> r.rss_rank0_mib >> r.rss_worker_mib)) return false;
  for (Step s; in >> tag && tag == "step" &&
               in >> s.forward_backward_s >> s.optim_s >> s.allreduce_calls >> s.allreduce_bytes >> s.allreduce_s >>
                   s.cpu_rank0_s >> s.cpu_workers_s >> s.sampled_tokens >> s.worker_samples >> s.allgather_bytes >>
                   s.reduce_scatter_bytes >> s.reduce_scatter_sent_bytes;)
    r.steps.push_back(s);
  return !r.steps.empty();
}

std::vector<std::string> settings_args(const Settings& s) {
  return {"--rlloop",     s.rlloop_bin,
          "--rounds",     std::to_string(s.rounds),
          "--steps",      std::to_string(s.steps),
          "--batch",      std::to_string(s.batch),
          "--tokens",     std::to_string(s.tokens),
          "--samples",    std::to_string(s.samples),
          "--max-tokens", std::to_string(s.max_tokens)};
}

// The parent's side: this program again with --case, its stdout read back (its stderr, and the workers', pass
// through as progress). False, with the child's output on stderr, when the case failed.
bool spawn_case(const Settings& settings, const Case& c, Run& run) {
  std::vector<std::string> args{fs::read_symlink("/proc/self/exe").string(), "--case", c.mode,
                                std::to_string(c.world_size), std::to_string(c.threads)};
  for (auto& a : settings_args(settings)) args.push_back(a);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0].c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    throw std::runtime_error("cannot start " + args[0]);
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !decode(out, run)) {
    std::fprintf(stderr, "  [%s W=%d threads=%d] FAILED (wait status %d): %s\n", c.mode.c_str(), c.world_size,
                 c.threads, status, out.c_str());
    return false;
  }
  return true;
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

Settings parse(int argc, char** argv, int from) {
  Settings s;
  for (int i = from; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--rlloop")
      s.rlloop_bin = value();
    else if (a == "--rounds")
      s.rounds = std::stoi(value());
    else if (a == "--steps")
      s.steps = std::stoi(value());
    else if (a == "--batch")
      s.batch = std::stoi(value());
    else if (a == "--tokens")
      s.tokens = std::stoi(value());
    else if (a == "--samples")
      s.samples = std::stoi(value());
    else if (a == "--max-tokens")
      s.max_tokens = std::stoi(value());
    else if (a == "--only")
      s.only = value();
    else
      throw std::runtime_error("unknown argument " + a);
  }
  if (s.rounds < 1 || s.steps < 1 || s.batch < 1 || s.tokens < 1 || s.samples < 1 || s.max_tokens < 1)
    throw std::runtime_error("--rounds, --steps, --batch, --tokens, --samples and --max-tokens must be >= 1");
  if (!s.only.empty() && s.only != "lora" && s.only != "full" && s.only != "sample")
    throw std::runtime_error("--only: lora, full or sample");
  return s;
}

std::string format(const char* fmt, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, value);
  return buf;
}

// One case's runs over all rounds, pooled.
struct Pooled {
  Case c;
  std::vector<Run> runs;
  bool failed = false;
  std::vector<double> all(double Step::*field) const {
    std::vector<double> v;
    for (const auto& r : runs)
      for (const auto& s : r.steps) v.push_back(s.*field);
    return v;
  }
  std::vector<double> step_s() const {
    std::vector<double> v;
    for (const auto& r : runs)
      for (const auto& s : r.steps) v.push_back(s.forward_backward_s + s.optim_s);
    return v;
  }
};

}  // namespace

int main(int argc, char** argv) try {
  if (argc >= 5 && std::string(argv[1]) == "--case") {
    const Settings settings = parse(argc, argv, 5);
    const Case c{argv[2], std::stoi(argv[3]), std::stoi(argv[4])};
    std::printf("%s", encode(run_case(settings, c)).c_str());
    return 0;
  }
  const Settings settings = parse(argc, argv, 1);
  std::string command = "data_parallel_bench";
  for (auto& a : settings_args(settings)) command += " " + a;
  if (!settings.only.empty()) command += " --only " + settings.only;
  std::printf(
      "%s\nrlloop-100m SFT, %d datums x %d tokens, cross_entropy, Adam; sampling, %d samples x up to %d new tokens; "
      "per case %d rounds of 1 warm-up + %d timed steps (calls)\n",
      command.c_str(), settings.batch, settings.tokens, settings.samples, settings.max_tokens, settings.rounds,
      settings.steps);
  std::printf("load average at start: %s\n", load_average().c_str());
  std::fflush(stdout);

  std::vector<Pooled> cases;
  for (const char* mode : {"lora", "full", "sample"}) {
    if (!settings.only.empty() && settings.only != mode) continue;
    const std::size_t first = cases.size();
    for (const Case& c : {Case{mode, 1, 2}, Case{mode, 1, 1}, Case{mode, 2, 1}}) cases.push_back({c, {}});
    if (std::string(mode) == "full")
      for (const char* sharded : {"sharded", "sharded-serial"}) cases.push_back({Case{sharded, 2, 1}, {}});
    const std::size_t n = cases.size() - first;
    for (int round = 0; round < settings.rounds; ++round)
      for (std::size_t k = 0; k < n; ++k) {
        Pooled& p = cases[first + (k + static_cast<std::size_t>(round)) % n];  // rotated: no case always first
        Run run;
        if (spawn_case(settings, p.c, run))
          p.runs.push_back(run);
        else
          p.failed = true;
        std::fflush(stderr);
      }
  }

  std::printf("load average at end: %s\n\n", load_average().c_str());
  std::printf(
      "| mode | W | threads/rank | trainable params | step s (median) | min-max | forward_backward s | optim_step s | "
      "all-reduce s/step | all-reduce bytes/step | CPU s/step rank 0 + rank 1 | step W=2 / W=1 2 threads | W=2 / W=1 "
      "1 thread | tokens/s |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  // A fully sharded case against full fine-tuning's one-rank cases.
  auto baseline = [&](const Pooled& p, int threads) -> const Pooled* {
    const std::string mode = p.c.sharded() ? "full" : p.c.mode;
    for (const auto& o : cases)
      if (o.c.mode == mode && o.c.world_size == 1 && o.c.threads == threads && !o.runs.empty()) return &o;
    return nullptr;
  };
  for (const auto& p : cases) {
    const char* mode = p.c.mode == "lora"      ? "LoRA r16 all-linear"
                       : p.c.mode == "full"    ? "full fine-tuning"
                       : p.c.mode == "sharded" ? "full fine-tuning, fully sharded"
                       : p.c.sharded()         ? "full fine-tuning, fully sharded, no prefetch"
                                               : "LoRA r16 sample call";
    if (p.runs.empty()) {
      std::printf("| %s | %d | %d | failed | | | | | | | | | | |\n", mode, p.c.world_size, p.c.threads);
      continue;
    }
    const auto steps = p.step_s();
    const double step = median(steps);
    std::string ar_s = "-", ar_bytes = "-", vs2 = "-", vs1 = "-";
    if (p.c.world_size > 1) {
      if (const Pooled* b = baseline(p, 2)) vs2 = format("%.2fx", step / median(b->step_s()));
      if (const Pooled* b = baseline(p, 1)) vs1 = format("%.2fx", step / median(b->step_s()));
    }
    if (p.c.world_size > 1 && p.c.mode != "sample") {
      ar_s = format("%.3f", median(p.all(&Step::allreduce_s)));
      const double bytes = median(p.all(&Step::allreduce_bytes));
      ar_bytes = format("%.0f", bytes) + format(" (%.1f MiB)", bytes / (1024.0 * 1024.0));
    }
    std::string cpu = format("%.2f", median(p.all(&Step::cpu_rank0_s)));
    if (p.c.world_size > 1) cpu += format(" + %.2f", median(p.all(&Step::cpu_workers_s)));
    const std::string tokens_per_s =
        p.c.mode == "sample" ? "-" : format("%.0f", settings.batch * settings.tokens / step);
    std::printf("| %s | %d | %d | %lld | %.2f | %.2f-%.2f | %.2f | %.2f | %s | %s | %s | %s | %s | %s |\n", mode,
                p.c.world_size, p.c.threads, static_cast<long long>(p.runs.front().trainable), step,
                *std::min_element(steps.begin(), steps.end()), *std::max_element(steps.begin(), steps.end()),
                median(p.all(&Step::forward_backward_s)), median(p.all(&Step::optim_s)), ar_s.c_str(), ar_bytes.c_str(),
                cpu.c_str(), vs2.c_str(), vs1.c_str(), tokens_per_s.c_str());
  }
  // The sharded case's volume against the model's: a step reduce-scatters every weight's gradient once and
  // all-gathers the root (embedding, final norm) once and each layer twice (forward, backward's recompute).
  for (const auto& p : cases) {
    if (!p.c.sharded() || p.runs.empty()) continue;
    const double model_share = static_cast<double>(p.runs.front().trainable) * 4.0 * (p.c.world_size - 1) /
                               p.c.world_size;  // fp32 bytes x (W - 1) / W
    const double gathered = median(p.all(&Step::allgather_bytes)), scattered = median(p.all(&Step::reduce_scatter_bytes));
    std::printf("%s W=%d, per step on rank 0: all-gathers received %.1f MiB (%.2fx the model's fp32 bytes "
                "x (W-1)/W, %.1f MiB), reduce-scatters %.1f MiB (%.2fx; %.1f MiB actually sent)\n",
                p.c.mode.c_str(), p.c.world_size, gathered / 1048576.0, gathered / model_share, model_share / 1048576.0,
                scattered / 1048576.0, scattered / model_share,
                median(p.all(&Step::reduce_scatter_sent_bytes)) / 1048576.0);
  }
  // What prefetch gains: each layer's all-gather started while the layer before it computes, against none.
  const Pooled* ahead = nullptr;
  const Pooled* serial = nullptr;
  for (const auto& p : cases) {
    if (p.runs.empty()) continue;
    if (p.c.mode == "sharded") ahead = &p;
    if (p.c.mode == "sharded-serial") serial = &p;
  }
  if (ahead && serial)
    std::printf("fully sharded W=2, prefetch (each layer's all-gather started a layer ahead) against none: step %.2f "
                "against %.2f s (%.3fx), forward_backward %.2f against %.2f s (%.3fx)\n",
                median(ahead->step_s()), median(serial->step_s()), median(ahead->step_s()) / median(serial->step_s()),
                median(ahead->all(&Step::forward_backward_s)), median(serial->all(&Step::forward_backward_s)),
                median(ahead->all(&Step::forward_backward_s)) / median(serial->all(&Step::forward_backward_s)));
  std::printf("\n");
  bool all_ok = true;
  for (const auto& p : cases) {
    all_ok = all_ok && !p.failed;
    if (p.runs.empty()) continue;
    std::vector<double> open;
    for (const auto& r : p.runs) open.push_back(r.open_s);
    std::vector<double> rss0, rss1;
    for (const auto& r : p.runs) {
      rss0.push_back(r.rss_rank0_mib);
      rss1.push_back(r.rss_worker_mib);
    }
    std::printf("%s W=%d threads=%d: %zu timed steps; session open %.1f s (median); resident memory after the steps: "
                "rank 0 %.0f MiB", p.c.mode.c_str(), p.c.world_size, p.c.threads, p.step_s().size(), median(open),
                median(rss0));
    if (p.c.world_size > 1) std::printf(", rank 1 %.0f MiB", median(rss1));
    if (p.c.mode == "sample") {
      const double tokens = median(p.all(&Step::sampled_tokens));
      std::printf("; %.0f new tokens per call, %.1f tokens/s; the worker decoded %.0f of %d samples", tokens,
                  tokens / median(p.step_s()), median(p.all(&Step::worker_samples)), settings.samples);
    } else if (p.c.world_size > 1) {
      const double bytes = median(p.all(&Step::allreduce_bytes)), seconds = median(p.all(&Step::allreduce_s));
      std::printf(
          ", weights broadcast at open %.1f MiB; %.0f all-reduce call(s) per step; bytes / (4 x trainable) = %.6f; "
          "%.2f GB/s",
          p.runs.front().broadcast_bytes / (1024.0 * 1024.0), median(p.all(&Step::allreduce_calls)),
          bytes / (4.0 * static_cast<double>(p.runs.front().trainable)), seconds > 0 ? bytes / seconds / 1e9 : 0.0);
    }
    std::printf("%s\n", p.failed ? " (some rounds FAILED, see above)" : "");
  }
  return all_ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "data_parallel_bench: %s\n", e.what());
  return 1;
}
