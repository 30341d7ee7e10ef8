// Monitor in one process: progress output, the SVG plot, JSON lines, the trace, debug-level parsing.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/linear.h>

#include "dtrain/monitor.h"
#include "common/util.h"
#include "svg_check.h"
#include "test_util.h"
#include "matchers.h"

namespace fs = std::filesystem;
using namespace dtrain;
using dtrain::test_util::error_of;
using dtrain::util::read_file;
using dtrain::util::split;

namespace {

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t i = 0; (i = s.find(what, i)) != std::string::npos; i += what.size()) ++n;
  return n;
}

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/dtrain_monitor_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
};

// Progress written into a temporary file (as if stdout were a pipe or a log file).
std::string progress_output(std::optional<bool> terminal, int steps, bool plain_lines = true) {
  std::FILE* f = std::tmpfile();
  Progress p(ProgressOptions()
                 .label("epoch 1/2")
                 .total(steps)
                 .samples_per_step(64)
                 .out(f)
                 .terminal(terminal)
                 .plain_lines(plain_lines));
  for (int s = 1; s <= steps; ++s) p.update(s, 1.0 / s);
  p.finish();
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  std::fclose(f);
  return out;
}

}  // namespace

TEST(Progress, PlainLinesWhenNotATerminal) {
  const std::string out = progress_output(false, 50);
  EXPECT_THAT(out, Not(HasSubstr("\r"))) << "no carriage returns in a log";
  EXPECT_THAT(out, Not(HasSubstr("\033"))) << "no escape codes in a log";
  const auto lines = split(out);
  ASSERT_EQ(lines.size(), 10u) << out;  // one per 10%
  for (const auto& l : lines) {
    EXPECT_EQ(l.rfind("epoch 1/2 ", 0), 0u) << l;
    EXPECT_THAT(l, HasSubstr("samples/s")) << l;
    EXPECT_THAT(l, HasSubstr("ETA")) << l;
  }
  EXPECT_THAT(lines[0], HasSubstr(" 10% 5/50")) << lines[0];
  EXPECT_THAT(lines.back(), HasSubstr("100% 50/50")) << lines.back();
}

TEST(Progress, WithoutPlainLinesOnlyATerminalGetsOutput) {
  // A program whose own metric lines are its log (train_llm) wants the bar and nothing else.
  EXPECT_EQ(progress_output(false, 50, /*plain_lines=*/false), "");
  EXPECT_THAT(progress_output(true, 3, /*plain_lines=*/false), HasSubstr("[===="));
}

TEST(Progress, BarOnATerminal) {
  const std::string out = progress_output(true, 3);
  EXPECT_THAT(out, HasSubstr("\r"));
  EXPECT_THAT(out, HasSubstr("[===")) << out;
  EXPECT_EQ(out.back(), '\n') << "finish() ends the bar's line";
}

TEST(Progress, MarkedLinesUnderTheLauncher) {
  // DTRAIN_PROGRESS_TTY=1 and stdout a pipe (here: a file in its place): each bar state is one line
  // starting with '\r', the plain lines start with '\v', and finish() sends "\r\n" (Note
  // [Launcher bar] in tools/dtrain-run/output.h).
  std::fflush(stdout);
  const int saved = ::dup(1);
  std::FILE* f = std::tmpfile();
  ASSERT_GE(::dup2(::fileno(f), 1), 0);
  ::setenv("DTRAIN_PROGRESS_TTY", "1", 1);
  {
    Progress p(ProgressOptions().label("epoch 1/1").total(20).samples_per_step(8));
    for (int s = 1; s <= 20; ++s) p.update(s, 1.0);
    p.finish();
  }
  std::fflush(stdout);
  ::unsetenv("DTRAIN_PROGRESS_TTY");
  ::dup2(saved, 1);
  ::close(saved);
  std::rewind(f);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  std::fclose(f);
  int bars = 0, plain = 0;
  const auto lines = split(out);
  for (const auto& l : lines) {
    ASSERT_FALSE(l.empty());
    if (l[0] == '\r' && l.size() > 1) {
      ++bars;
      EXPECT_THAT(l, Not(HasSubstr("\033"))) << "the launcher does the erasing";
      EXPECT_THAT(l, HasSubstr("epoch 1/1 [=")) << l;
    } else if (l[0] == '\v') {
      ++plain;
    } else {
      EXPECT_EQ(l, "\r") << "only marked lines";
    }
  }
  EXPECT_GE(bars, 2) << "the first and the last state at least";
  EXPECT_EQ(plain, 10) << "the log files keep a line per 10%";
  EXPECT_EQ(lines.back(), "\r") << "finish() ends the bar";
}

TEST(Progress, BadTotalIsAClearError) {
  EXPECT_THAT(error_of([] { Progress p(ProgressOptions().total(0)); }), HasSubstr("total must be > 0"));
}

TEST(Plot, SvgIsWellFormedWithOnePointPerValue) {
  PlotSeries a{"loss <train>", {1, 2, 3, 4}, {2.0, 1.5, 1.2, 1.0}};
  PlotSeries b{"accuracy", {1, 2, 3, 4}, {NAN, NAN, NAN, NAN}};  // no data: a note, no polyline
  PlotSeries c{"throughput", {10}, {500}};                       // one point: still drawn
  const std::string svg = svg_plot({a, b, c}, "run & test");
  EXPECT_EQ(test_util::svg_problem(svg), "");
  EXPECT_THAT(svg, HasSubstr("loss &lt;train&gt;")) << "titles are escaped";
  EXPECT_THAT(svg, HasSubstr("no data"));
  EXPECT_EQ(test_util::polyline_point_counts(svg), (std::vector<int>{4, 1}));
  // The checker itself catches broken documents.
  EXPECT_NE(test_util::svg_problem(svg.substr(0, svg.size() - 8)), "");
  EXPECT_NE(test_util::svg_problem("<svg><g></svg>"), "");
}

TEST(Monitor, JsonLinesTraceAndPlotInOneProcess) {
  TempDir dir;
  torch::manual_seed(0);
  torch::nn::Linear model(8, 4);
  {
    Monitor mon(MonitorOptions()
                    .output_dir(dir.path.string())
                    .log_every(5)
                    .trace_steps(3)
                    .per_rank_metrics(true)
                    .progress(false));
    mon.watch_parameters(model->parameters());
    for (int step = 1; step <= 12; ++step) {
      at::Tensor loss;
      {
        auto p = mon.phase(Phase::kForward);
        loss = model(at::randn({16, 8})).pow(2).mean();
      }
      {
        auto p = mon.phase(Phase::kBackward);
        model->zero_grad();
        loss.backward();
      }
      {
        auto p = mon.phase(Phase::kOptimizer);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      mon.end_step(StepInfo().loss(step).samples(16).accuracy(0.5).lr(0.1));
      if (step == 6 || step == 12) mon.log_epoch(step / 6, EpochInfo().train_loss(7.0 - step / 6).test_accuracy(0.75));
    }
    ASSERT_EQ(mon.epochs().size(), 2u);
    EXPECT_EQ(mon.epochs()[0].step, 6);
    EXPECT_EQ(mon.epochs()[1].epoch, 2);
    EXPECT_EQ(mon.epochs()[1].train_loss, 5.0);
    EXPECT_TRUE(std::isnan(mon.epochs()[1].test_loss));
    const StepMetrics& last = mon.last_step();
    EXPECT_EQ(last.step, 12);
    EXPECT_GE(last.optimizer_ms, 2.0);
    EXPECT_TRUE(std::isnan(last.grad_norm)) << "computed on a window's last step only (steps 5, 10)";
    EXPECT_GE(last.step_ms, last.forward_ms + last.backward_ms + last.optimizer_ms - 1e-9);
    mon.close();
    ASSERT_EQ(mon.windows().size(), 3u);
  }

  // metrics.jsonl: one window per line (steps 5, 10, and the last partial window at close).
  const auto lines = split(read_file((dir.path / "metrics.jsonl").string()));
  ASSERT_EQ(lines.size(), 3u);
  const int64_t expect_step[] = {5, 10, 12}, expect_steps[] = {5, 5, 2};
  const double expect_loss[] = {3.0, 8.0, 11.5};  // means of the losses given
  for (size_t i = 0; i < lines.size(); ++i) {
    auto j = nlohmann::json::parse(lines[i]);
    EXPECT_EQ(j["step"], expect_step[i]);
    EXPECT_EQ(j["steps"], expect_steps[i]);
    EXPECT_DOUBLE_EQ(j["loss"].get<double>(), expect_loss[i]);
    EXPECT_DOUBLE_EQ(j["accuracy"].get<double>(), 0.5);
    EXPECT_DOUBLE_EQ(j["lr"].get<double>(), 0.1);
    EXPECT_GT(j["grad_norm"].get<double>(), 0.0);
    EXPECT_GT(j["samples_per_s"].get<double>(), 0.0);
    for (const char* f :
         {"step_ms", "other_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_ms", "comm_wait_ms", "rss_mb"}) {
      ASSERT_TRUE(j.contains(f)) << f;
      for (const char* k : {"min", "mean", "max", "max_rank"}) EXPECT_TRUE(j[f].contains(k)) << f << "." << k;
      EXPECT_LE(j[f]["min"].get<double>(), j[f]["max"].get<double>()) << f;
    }
    EXPECT_GE(j["optimizer_ms"]["mean"].get<double>(), 2.0);
    EXPECT_EQ(j["comm_ms"]["max"].get<double>(), 0.0) << "no DDP, no communication";
    EXPECT_GT(j["rss_mb"]["mean"].get<double>(), 10.0);
    EXPECT_EQ(j["slowest_rank"], 0);
  }
  // Per-rank lines: every step.
  const auto rank_lines = split(read_file((dir.path / "metrics_rank0.jsonl").string()));
  ASSERT_EQ(rank_lines.size(), 12u);
  EXPECT_EQ(nlohmann::json::parse(rank_lines[11])["step"], 12);

  // trace.json: valid JSON; the first 3 steps only; the part file is gone.
  auto trace = nlohmann::json::parse(read_file((dir.path / "trace.json").string()));
  int forwards = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["name"] == "forward") {
      ++forwards;
      EXPECT_EQ(e["ph"], "X");
      EXPECT_GE(e["dur"].get<double>(), 0.0);
    }
  EXPECT_EQ(forwards, 3);
  EXPECT_FALSE(fs::exists(dir.path / "trace_rank0.part"));

  const std::string svg = read_file((dir.path / "plot.svg").string());
  EXPECT_EQ(test_util::svg_problem(svg), "");
  // Lines: loss per window and per epoch (train), accuracy per window and per epoch (test),
  // throughput; the parts never logged (test loss, train accuracy per epoch) are left out.
  EXPECT_EQ(test_util::polyline_point_counts(svg), (std::vector<int>{3, 2, 3, 2, 3}));
  EXPECT_EQ(count(svg, "r=\"3.5\""), 9) << "a dot per window point";
  EXPECT_EQ(count(svg, "r=\"6\""), 4) << "a ring per epoch point";
  EXPECT_EQ(count(svg, "<polygon"), 3) << "compute, communication hidden, communication waited";
  EXPECT_THAT(svg, HasSubstr(">test (epoch)</text>")) << "legend";
  EXPECT_EQ(svg.find(">train (epoch)</text>", svg.find(">accuracy</text>")), std::string::npos)
      << "no legend entry for a series without data";
  // The x axis spans the steps run, 0..12, with ticks.
  EXPECT_THAT(svg, HasSubstr(">0</text>"));
  EXPECT_THAT(svg, HasSubstr(">12</text>"));
}

TEST(Plot, OneWindowShowsItsPointOverTheStepsRun) {
  // A 47-step run with windows of 50 steps has one window: its point must show (a marker; a
  // polyline of one point draws nothing) and the x axis must span 0..47, not 47..48.
  PlotPanel loss{"loss", {PlotSeries{"train", {47}, {0.9}}}};
  PlotPanel split{"split", {PlotSeries{"a", {47}, {3}}, PlotSeries{"b", {47}, {1}}}, true};
  const std::string svg = svg_plot({loss, split}, "short", 0, 47);
  EXPECT_EQ(test_util::svg_problem(svg), "");
  EXPECT_EQ(count(svg, "<circle"), 1);
  EXPECT_EQ(count(svg, "<polygon"), 2) << "one point of a stacked area: a bar";
  EXPECT_THAT(svg, HasSubstr(">0</text>"));
  EXPECT_THAT(svg, HasSubstr(">40</text>"));
  EXPECT_THAT(svg, Not(HasSubstr(">48</text>")));
  // The y axis: the stack's total (4) is inside it, and it starts at 0.
  EXPECT_THAT(svg, HasSubstr(">4</text>"));
  // Grid lines: light lines on both axes.
  EXPECT_GE(count(svg, "<line "), 8);
}

// The files a Monitor writes are created, never opened through a link planted at their names (an
// output folder others can write): the link's target is left alone and the error names the file.
TEST(Monitor, ALinkAtAnOutputFileIsNotFollowed) {
  const fs::path dir = fs::temp_directory_path() / ("dtrain_monitor_link_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path target = dir / "target";
  std::ofstream(target) << "keep";
  fs::create_symlink(target, dir / "metrics.jsonl");
  EXPECT_THAT(
      error_of([&] { Monitor m(MonitorOptions().output_dir(dir.string())); }),
      HasSubstr("Monitor: cannot create " + (dir / "metrics.jsonl").string() + ": Too many levels of symbolic links"));
  EXPECT_EQ(read_file(target.string()), "keep");
  // The trace file and the TensorBoard events are created the same way (util::create_file).
  fs::remove(dir / "metrics.jsonl");
  fs::create_symlink(target, dir / "trace_rank0.part");
  EXPECT_THAT(error_of([&] { Monitor m(MonitorOptions().output_dir(dir.string()).trace_steps(1)); }),
              HasSubstr("trace_rank0.part: Too many levels of symbolic links"));
  EXPECT_EQ(read_file(target.string()), "keep");
  fs::remove_all(dir);
}

TEST(Monitor, BadOptionsAreClearErrors) {
  EXPECT_THAT(error_of([] { Monitor m(MonitorOptions().log_every(0)); }), HasSubstr("log_every must be > 0"));
  EXPECT_THAT(error_of([] { Monitor m(MonitorOptions().output_dir("/proc/no/such")); }), HasSubstr("/proc/no/such"));
}

TEST(Status, MonitorTrainingLines) {
  const std::string s = training_status();
  EXPECT_THAT(s, HasSubstr("Rank: 0, World Size: 1")) << s;
  EXPECT_THAT(s, HasSubstr("Device: cpu")) << s;
  EXPECT_THAT(s, HasSubstr("Memory: RSS")) << s;
  EXPECT_GT(memory_info().rss_bytes, 0);
}

TEST(DebugLevel, ReadFromTheEnvironment) {
  ::setenv("DTRAIN_DEBUG", "DETAIL", 1);
  set_debug_level_from_env();
  EXPECT_EQ(get_debug_level(), DebugLevel::DETAIL);
  ::setenv("DTRAIN_DEBUG", "INFO", 1);
  set_debug_level_from_env();
  EXPECT_EQ(get_debug_level(), DebugLevel::INFO);
  ::setenv("DTRAIN_DEBUG", "LOUD", 1);
  const std::string err = error_of([] { set_debug_level_from_env(); });
  EXPECT_THAT(err, HasSubstr("DTRAIN_DEBUG=LOUD")) << err;
  EXPECT_THAT(err, HasSubstr("OFF, INFO or DETAIL")) << err;
  ::unsetenv("DTRAIN_DEBUG");
  set_debug_level_from_env();
  EXPECT_EQ(get_debug_level(), DebugLevel::OFF);
}
