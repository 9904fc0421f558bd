// The journal on its own: the fold of its records (retention of results and client tokens, unfinished operations
// kept, what a restart replays), snapshots that load back to the same state, a process killed with SIGKILL at each
// step of a compaction (recovery loses nothing appended and applies nothing twice), torn lines, the unversioned
// journal.jsonl of servers from before snapshots, and compactions started by the record bound.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "server/journal.hpp"

using namespace rlloop;
using namespace rlloop::server;
namespace fs = std::filesystem;

namespace {

// Record times: fixed, so that a death test's child writes what its parent expects. The retentions below keep
// entries for a century, so that a compaction (which expires by age at the wall clock) keeps them too.
constexpr double kNow = 1.0e9 + 0.123;  // operation_tag: "123"
constexpr std::chrono::seconds kCentury{100LL * 366 * 24 * 3600};

double wall_clock() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

json session_record(const std::string& name, double created = kNow) {
  return {{"t", "session"},         {"tenant", "a"}, {"session", name}, {"arn", "arn:session/" + name},
          {"baseModel", "tiny"},    {"rank", 4},     {"alpha", 8},      {"echo", json::object()},
          {"creationTime", created}};
}

json accept_record(const std::string& session, const std::string& id, const std::string& member, double time,
                   std::optional<std::string> token = {}, std::int64_t seq = -1) {
  json rec{{"t", "accept"},
           {"tenant", "a"},
           {"session", session},
           {"id", id},
           {"sampling", member == "sample" || member == "loadWeightsForSampling"},
           {"digest", request_digest(id)},
           {"body", {{"operationConfig", {{member, {{"modelPackageArn", "arn:package/1"}}}}}}},
           {"time", time}};
  if (token) rec["token"] = *token;
  if (seq >= 0) rec["seq"] = seq;
  return rec;
}

json done_record(const std::string& session, const std::string& id, double time, std::int64_t training_tokens = 0,
                 const std::string& status = "Completed") {
  return {{"t", "done"},
          {"tenant", "a"},
          {"session", session},
          {"id", id},
          {"state", {{"status", status}, {"id", id}}},
          {"usage", {{"prefill", 0}, {"sample", 0}, {"training", training_tokens}}},
          {"time", time}};
}

Retention retention(std::size_t count) {
  Retention r;
  r.results = count;
  r.result_age = kCentury;
  r.client_tokens = count;
  r.client_token_age = kCentury;
  return r;
}
Retention small_retention() { return retention(2); }

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("rlloop-journal-" + name + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
  }
  ~TempDir() {
    if (!::testing::Test::HasFailure()) fs::remove_all(path);
  }
};

JournalOptions manual_compaction() {
  JournalOptions o;
  o.retention = retention(100);
  o.compact_records = 0;
  o.compact_bytes = 0;
  return o;
}

// The state as text (a snapshot of generation 0), to compare two states.
std::string text(const DurableState& s) { return s.snapshot(0); }

}  // namespace

TEST(RetainedMap, KeepsTheMostRecentEntriesYoungerThanTheAge) {
  RetainedMap<int> m(2, 10.0);
  m.put("a", 1, 100);
  m.put("b", 2, 101);
  m.put("c", 3, 102);  // a falls out: 3 > 2
  EXPECT_EQ(m.find("a", 102), nullptr);
  ASSERT_NE(m.find("b", 102), nullptr);
  EXPECT_EQ(*m.find("b", 102), 2);
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m.find("b", 111), nullptr) << "10 s old at 111: expired even before expire() drops it";
  EXPECT_NE(m.find("c", 111), nullptr);
  m.expire(111);
  EXPECT_EQ(m.size(), 1u);
  m.put("c", 4, 112);  // replacing keeps one entry of the key, at its new place
  std::vector<std::string> keys;
  m.for_each([&](const std::string& k, int v, double) { keys.push_back(k + "=" + std::to_string(v)); });
  EXPECT_EQ(keys, std::vector<std::string>{"c=4"});
}

TEST(DurableState, KeepsTheLastResultsAndNeverAnUnfinishedOperation) {
  DurableState s(small_retention());
  s.apply(session_record("s"));
  for (const char* id : {"op-1", "op-2", "op-3", "op-4"}) s.apply(accept_record("s", id, "forward", kNow));
  s.apply(done_record("s", "op-1", kNow, 5));
  s.apply(done_record("s", "op-2", kNow, 5));
  s.apply(done_record("s", "op-3", kNow, 5));
  const auto& session = s.sessions.at({"a", "s"});
  EXPECT_EQ(session.results.find("op-1", kNow), nullptr) << "the oldest of three finished, with room for two";
  ASSERT_NE(session.results.find("op-3", kNow), nullptr);
  EXPECT_EQ(session.results.find("op-3", kNow)->state["status"], "Completed");
  ASSERT_EQ(session.pending.size(), 1u) << "op-4 never finished: kept whatever the count";
  EXPECT_EQ(session.pending[0]["id"], "op-4");
  EXPECT_EQ(session.usage.training, 15);
  EXPECT_EQ(s.tenants.at("a").usage.training, 15);
}

TEST(DurableState, ClientTokensHaveTheirOwnWindow) {
  DurableState s(small_retention());
  s.apply(session_record("s"));
  s.apply(accept_record("s", "op-1", "forward", kNow, "t1", 1));
  s.apply(accept_record("s", "op-2", "forward", kNow, "t2", 2));
  s.apply(accept_record("s", "op-3", "forward", kNow, "t3", 3));
  const auto& session = s.sessions.at({"a", "s"});
  EXPECT_EQ(session.tokens.find("t1", kNow), nullptr);
  ASSERT_NE(session.tokens.find("t3", kNow), nullptr);
  EXPECT_EQ(session.tokens.find("t3", kNow)->operation_id, "op-3");
  EXPECT_EQ(session.tokens.find("t3", kNow)->digest, request_digest("op-3"));
  DurableState day(Retention{});
  day.apply(session_record("s"));
  day.apply(accept_record("s", "op-1", "forward", kNow, "t1", 1));
  EXPECT_NE(day.sessions.at({"a", "s"}).tokens.find("t1", kNow + 24 * 3600 - 1), nullptr);
  EXPECT_EQ(day.sessions.at({"a", "s"}).tokens.find("t1", kNow + 24 * 3600), nullptr) << "by default, for a day";
  EXPECT_EQ(session.last_sequence, 3);
}

TEST(DurableState, ReplaysWhatChangedTheStateSinceTheLastAutosave) {
  DurableState s(retention(100));
  s.apply(session_record("s"));
  s.apply(accept_record("s", "op-1", "forwardBackward", kNow));
  s.apply(done_record("s", "op-1", kNow));
  s.apply(accept_record("s", "op-2", "optimizerStep", kNow));
  json step = done_record("s", "op-2", kNow);
  step["autosave"] = "/autosave/2";
  s.apply(step);
  s.apply(accept_record("s", "op-3", "forwardBackward", kNow));
  s.apply(done_record("s", "op-3", kNow));
  s.apply(accept_record("s", "op-4", "forward", kNow));
  s.apply(done_record("s", "op-4", kNow));
  s.apply(accept_record("s", "op-5", "loadWeightsForSampling", kNow));
  s.apply(done_record("s", "op-5", kNow));
  const auto& session = s.sessions.at({"a", "s"});
  EXPECT_EQ(session.autosave, "/autosave/2");
  ASSERT_EQ(session.replay.size(), 1u);
  EXPECT_EQ(session.replay[0]["id"], "op-3");
  EXPECT_EQ(session.sampler_arn, "arn:package/1");
  s.apply({{"t", "status"}, {"tenant", "a"}, {"session", "s"}, {"status", "Stopped"}, {"time", kNow}});
  s.apply({{"t", "delete"}, {"tenant", "a"}, {"session", "s"}});
  EXPECT_TRUE(s.sessions.empty());
}

TEST(DurableState, OperationIdsOfTheSessionAreCountedPastTheirResults) {
  DurableState s(small_retention());
  s.apply(session_record("s"));
  const std::string id = "op-" + operation_tag(kNow) + "-7";
  EXPECT_EQ(operation_ordinal(id, kNow), 7);
  EXPECT_EQ(operation_ordinal("op-0-7", kNow), std::nullopt);
  s.apply(accept_record("s", id, "forward", kNow));
  EXPECT_EQ(s.sessions.at({"a", "s"}).next_operation, 8);
}

TEST(DurableState, ASnapshotLoadsBackToTheSameState) {
  DurableState s(small_retention());
  s.apply(session_record("s"));
  s.apply(session_record("t"));
  s.apply({{"t", "checkpoint"}, {"tenant", "a"}, {"arn", "arn:package/3"}, {"path", "/ckpt/3"}, {"n", 3}});
  s.apply(accept_record("s", "op-1", "forwardBackward", kNow, "t1", 1));
  s.apply(done_record("s", "op-1", kNow, 9));
  s.apply(accept_record("s", "op-2", "sample", kNow, "k2"));
  s.apply(done_record("s", "op-2", kNow, 1));
  s.apply(accept_record("s", "op-3", "optimizerStep", kNow, "t3", 3));
  s.apply({{"t", "billed"}, {"tenant", "a"}, {"session", "t"}, {"usage", {{"sample", 4}}}});
  s.apply({{"t", "status"}, {"tenant", "a"}, {"session", "t"}, {"status", "Failed"}, {"error", "x"}, {"time", 1.5}});

  DurableState loaded(small_retention());
  std::istringstream lines(s.snapshot(7));
  std::string line;
  std::getline(lines, line);  // header
  while (std::getline(lines, line))
    if (json rec = json::parse(line); rec["t"] != "end") loaded.apply(rec);
  EXPECT_EQ(text(loaded), text(s));
  EXPECT_EQ(loaded.tenants.at("a").next_checkpoint, 4);
  EXPECT_EQ(loaded.tenants.at("a").usage.training, 10);
  EXPECT_EQ(loaded.sessions.at({"a", "t"}).status, wire::SessionStatus::failed);
  EXPECT_EQ(loaded.sessions.at({"a", "s"}).replay.size(), 1u);
  // The snapshot keeps the status as its wire string, as the log's records do.
  EXPECT_NE(s.snapshot(7).find(R"("status":"Failed")"), std::string::npos);
}

TEST(DurableState, AStatusItDoesNotKnowIsAMalformedRecord) {
  DurableState s(small_retention());
  s.apply(session_record("s"));
  EXPECT_THROW(s.apply({{"t", "status"}, {"tenant", "a"}, {"session", "s"}, {"status", "Paused"}, {"time", kNow}}),
               invalid_argument);
  EXPECT_EQ(s.sessions.at({"a", "s"}).status, wire::SessionStatus::running);
}

namespace {

// Appended before the compaction that is killed: two sessions, results, tokens, a checkpoint, billing.
std::vector<json> history() {
  std::vector<json> out{session_record("s"), session_record("t")};
  for (int i = 1; i <= 6; ++i) {
    const std::string id = "op-" + std::to_string(i);
    out.push_back(accept_record(i % 2 ? "s" : "t", id, "forwardBackward", kNow + i, "tok" + std::to_string(i), i));
    if (i < 6) out.push_back(done_record(i % 2 ? "s" : "t", id, kNow + i, i));
  }
  out.push_back({{"t", "checkpoint"}, {"tenant", "a"}, {"arn", "arn:package/1"}, {"path", "/ckpt/1"}, {"n", 1}});
  return out;
}

// Appended while the compaction runs, once appends went to the new log.
json appended_during_compaction() { return done_record("t", "op-6", kNow + 7, 6); }

// In the child: a journal with one compaction behind it, then a second one killed with SIGKILL after `at`.
[[noreturn]] void compact_and_die(const fs::path& dir, CompactionStep at) {
  JournalOptions o = manual_compaction();
  o.retention = small_retention();
  Journal* journal = nullptr;
  o.on_compaction_step = [&](CompactionStep step) {
    if (step == CompactionStep::log_switched && journal->generation() == 2)
      journal->append(appended_during_compaction());
    if (step == at && journal->generation() == 2) ::raise(SIGKILL);
  };
  Journal j(dir.string(), o);
  journal = &j;
  const auto records = history();
  for (std::size_t i = 0; i < records.size(); ++i) {
    j.append(records[i]);
    if (i == records.size() / 2) j.compact();  // generation 1: a snapshot and a log before the one that dies
  }
  j.compact();
  ::_exit(0);  // not reached
}

}  // namespace

DurableState state_after_the_kill() {
  DurableState s(small_retention());
  for (const json& rec : history()) s.apply(rec);
  s.apply(appended_during_compaction());
  return s;
}

TEST(Journal, AKillAtAnyStepOfACompactionLosesNothing) {
  const CompactionStep steps[] = {CompactionStep::log_switched, CompactionStep::snapshot_half_written,
                                  CompactionStep::snapshot_written, CompactionStep::snapshot_renamed,
                                  CompactionStep::old_logs_removed};
  for (CompactionStep at : steps) {
    SCOPED_TRACE("killed after step " + std::to_string(static_cast<int>(at)));
    TempDir dir("kill-" + std::to_string(static_cast<int>(at)));
    DurableState expected = state_after_the_kill();
    EXPECT_EXIT(compact_and_die(dir.path, at), ::testing::KilledBySignal(SIGKILL), "");
    JournalOptions o = manual_compaction();
    o.retention = small_retention();
    {
      Journal j(dir.path.string(), o);
      EXPECT_EQ(text(j.state()), text(expected));
      EXPECT_EQ(j.generation(), 2u) << "appends go on in the log the compaction started";
      EXPECT_FALSE(fs::exists(dir.path / "snapshot.jsonl.tmp"));
      EXPECT_FALSE(fs::exists(dir.path / "journal-0.jsonl"));
      // The recovered journal goes on: one more record, a full compaction, and a restart keep everything.
      j.append(accept_record("s", "op-7", "forward", kNow + 8));
      j.compact();
    }
    expected.apply(accept_record("s", "op-7", "forward", kNow + 8));
    Journal again(dir.path.string(), o);
    EXPECT_EQ(text(again.state()), text(expected));
    EXPECT_EQ(again.generation(), 3u);
    EXPECT_FALSE(fs::exists(dir.path / "journal-2.jsonl")) << "a completed compaction removes the logs it holds";
  }
}

TEST(Journal, ATornLastLineIsSkippedAndTheNextRecordStartsOnItsOwnLine) {
  TempDir dir("torn");
  {
    Journal j(dir.path.string(), manual_compaction());
    j.append(session_record("s"));
    j.append(accept_record("s", "op-1", "forward", kNow));
  }
  std::ofstream(dir.path / "journal-0.jsonl", std::ios::app) << R"({"t": "done", "tenant": "a", "sess)";
  {
    Journal j(dir.path.string(), manual_compaction());
    EXPECT_EQ(j.state().sessions.at({"a", "s"}).pending.size(), 1u);
    j.append(done_record("s", "op-1", kNow));
  }
  Journal j(dir.path.string(), manual_compaction());
  const auto& session = j.state().sessions.at({"a", "s"});
  EXPECT_TRUE(session.pending.empty());
  EXPECT_NE(session.results.find("op-1", kNow), nullptr);
}

TEST(Journal, TheUnversionedJournalOfEarlierServersLoads) {
  TempDir dir("unversioned");
  fs::create_directories(dir.path);
  json accept = accept_record("s", "op-1", "forward", kNow, "tok", 1);
  accept.erase("digest");
  accept.erase("time");
  accept["fingerprint"] = "1:{\"forward\":{}}";
  json done = done_record("s", "op-1", kNow, 3);
  done.erase("time");
  std::ofstream(dir.path / "journal.jsonl") << session_record("s").dump() << "\n"
                                            << accept.dump() << "\n"
                                            << done.dump() << "\n";
  Journal j(dir.path.string(), manual_compaction());
  const auto& session = j.state().sessions.at({"a", "s"});
  const double now = wall_clock();
  ASSERT_NE(session.results.find("op-1", now), nullptr) << "records without a time count from when they load";
  ASSERT_NE(session.tokens.find("tok", now), nullptr);
  EXPECT_EQ(session.tokens.find("tok", now)->digest, request_digest("1:{\"forward\":{}}"));
  EXPECT_EQ(session.usage.training, 3);
  EXPECT_FALSE(fs::exists(dir.path / "journal.jsonl"));
  EXPECT_TRUE(fs::exists(dir.path / "journal-0.jsonl"));
}

TEST(Journal, CompactsOnItsOwnOnceTheLogHoldsTheRecordBound) {
  TempDir dir("auto");
  JournalOptions o;
  o.retention = retention(100);
  o.compact_records = 5;
  o.compact_bytes = 0;
  std::mutex mu;
  std::vector<std::string> events;
  o.log = [&](const std::string& line) {
    std::lock_guard lock(mu);
    events.push_back(line);
  };
  DurableState expected(o.retention);
  {
    Journal j(dir.path.string(), o);
    for (const json& rec : history()) {
      j.append(rec);
      expected.apply(rec);
    }
    // The compactor thread runs on its own: wait for its event (bounded), not for a time.
    for (int i = 0; i < 1000 && j.generation() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_GE(j.generation(), 1u);
  }
  {
    std::lock_guard lock(mu);
    ASSERT_FALSE(events.empty());
    EXPECT_NE(events.front().find("\"event\":\"compacted\""), std::string::npos) << events.front();
  }
  EXPECT_TRUE(fs::exists(dir.path / "snapshot.jsonl"));
  JournalOptions reopened = manual_compaction();
  reopened.retention = o.retention;
  Journal j(dir.path.string(), reopened);
  EXPECT_EQ(text(j.state()), text(expected));
}
