// The environment table (src/common/env.h): its accessors validate every value, docs/environment.md
// shows exactly its rows, every DTRAIN_* name in the sources is one of them, and nothing but
// src/common/env.cpp reads the environment.
//
// `env_test --print-tables` prints the tables docs/environment.md must hold.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "common/env.h"
#include "common/util.h"
#include "dtrain/process_group.h"
#include "test_util.h"
#include "matchers.h"

namespace env = dtrain::env;
namespace fs = std::filesystem;
using dtrain::test_util::error_of;
using dtrain::util::read_file;

namespace {

const fs::path kRoot = DTRAIN_SOURCE_DIR;

env::Lookup vars(std::map<std::string, std::string> m) {
  return [m](const std::string& name) -> std::optional<std::string> {
    auto it = m.find(name);
    if (it == m.end() || it->second.empty()) return std::nullopt;
    return it->second;
  };
}

// The C++ files of the library, its public headers and the launcher.
std::vector<fs::path> sources() {
  std::vector<fs::path> out;
  for (const char* dir : {"src", "include", "tools"})
    for (const auto& e : fs::recursive_directory_iterator(kRoot / dir)) {
      const std::string ext = e.path().extension().string();
      if (e.is_regular_file() && (ext == ".h" || ext == ".hpp" || ext == ".cpp")) out.push_back(e.path());
    }
  return out;
}

// Reads k through the accessor of its type (the fallback, with an empty lookup).
void read_as_its_type(const env::Knob& k, const env::Lookup& from) {
  switch (k.type) {
    case env::Type::kFlag:
      env::flag(k.name, from);
      return;
    case env::Type::kChoice:
      env::choice(k.name, from);
      return;
    case env::Type::kInteger:
      env::integer(k.name, from);
      return;
    case env::Type::kSeconds:
      env::seconds(k.name, from);
      return;
    case env::Type::kPort:
      env::port(k.name, from);
      return;
    case env::Type::kHost:
      env::host(k.name, from);
      return;
    case env::Type::kText:
      env::text(k.name, from);
      return;
    case env::Type::kList:
      env::list(k.name, from);
      return;
  }
}

std::string without_line_comments(const std::string& line) {
  const auto c = line.find("//");
  return c == std::string::npos ? line : line.substr(0, c);
}

}  // namespace

TEST(Env, UnsetVariablesHaveTheTablesFallback) {
  const auto none = vars({{"DTRAIN_SHM", ""}});  // empty counts as unset
  EXPECT_EQ(env::choice("DTRAIN_SHM", none), "auto");
  EXPECT_EQ(env::choice("DTRAIN_DEBUG", none), "OFF");
  EXPECT_EQ(env::choice("DTRAIN_BACKEND", none), "gloo");
  // init_process_group's timeout when neither InitOptions nor the variable sets one: the public
  // kDefaultTimeout, PyTorch's 30 min.
  EXPECT_EQ(env::seconds("DTRAIN_TIMEOUT_S", none).value() * 1000, double(dtrain::kDefaultTimeout.count()));
  EXPECT_EQ(env::seconds("DTRAIN_RUN_RDZV_REPORT_S", none), 30.0);  // docs: "then every 30 s"
  EXPECT_EQ(env::integer("DTRAIN_SHM_SLOT_BYTES", none), int64_t{1} << 20);
  EXPECT_TRUE(env::flag("DTRAIN_MALLOC_TUNING", none));
  EXPECT_FALSE(env::flag("DTRAIN_PYTORCH_PEERS", none));
  EXPECT_EQ(env::integer("RANK", none), std::nullopt);
  EXPECT_EQ(env::host("MASTER_ADDR", none), std::nullopt);
  EXPECT_EQ(env::port("MASTER_PORT", none), std::nullopt);
  EXPECT_EQ(env::text("DTRAIN_SHM_HOST", none), std::nullopt);
  EXPECT_TRUE(env::list("GLOO_SOCKET_IFNAME", none).empty());
}

TEST(Env, GoodValuesAreParsed) {
  const auto v = vars({{"DTRAIN_SHM", "0"},
                       {"DTRAIN_DEBUG", "DETAIL"},
                       {"DTRAIN_TIMEOUT_S", "2.5"},
                       {"DTRAIN_SHM_SLOT_BYTES", "4096"},
                       {"DTRAIN_PYTORCH_PEERS", "1"},
                       {"RANK", "3"},
                       {"MASTER_ADDR", "node0.example"},
                       {"MASTER_PORT", "29500"},
                       {"GLOO_SOCKET_IFNAME", "eth0,,ib0"},
                       {"DTRAIN_SHM_HOST", "a b"}});
  EXPECT_EQ(env::choice("DTRAIN_SHM", v), "0");
  EXPECT_EQ(env::choice("DTRAIN_DEBUG", v), "DETAIL");
  EXPECT_EQ(env::seconds("DTRAIN_TIMEOUT_S", v), 2.5);
  EXPECT_EQ(env::integer("DTRAIN_SHM_SLOT_BYTES", v), 4096);
  EXPECT_TRUE(env::flag("DTRAIN_PYTORCH_PEERS", v));
  EXPECT_EQ(env::integer("RANK", v), 3);
  EXPECT_EQ(env::host("MASTER_ADDR", v), "node0.example");
  EXPECT_EQ(env::port("MASTER_PORT", v), 29500);
  EXPECT_EQ(env::list("GLOO_SOCKET_IFNAME", v), (std::vector<std::string>{"eth0", "ib0"}));
  EXPECT_EQ(env::text("DTRAIN_SHM_HOST", v), "a b");
}

// Durations become milliseconds without overflow and without a wait of nothing: the smallest
// positive wait is 1 ms (DTRAIN_TIMEOUT_S=0.0001 too), a whole number of milliseconds stays whole, and
// inf, 1e300 and milliseconds::max() are forever, a deadline that is still ahead of now().
TEST(Env, DurationsNeitherOverflowNorRoundToNothing) {
  using dtrain::util::kForever;
  using std::chrono::milliseconds;
  EXPECT_EQ(dtrain::util::millis_of_seconds(0.0001), milliseconds(1));
  EXPECT_EQ(dtrain::util::millis_of_seconds(*env::seconds("DTRAIN_TIMEOUT_S", vars({{"DTRAIN_TIMEOUT_S", "0.0001"}}))),
            milliseconds(1));
  EXPECT_EQ(dtrain::util::millis_of_seconds(0.0015), milliseconds(2));
  EXPECT_EQ(dtrain::util::millis_of_seconds(2.3), milliseconds(2300));
  EXPECT_EQ(dtrain::util::millis_of_seconds(0), milliseconds(0));
  EXPECT_EQ(dtrain::util::millis_of_seconds(1e300), kForever);
  EXPECT_EQ(dtrain::util::millis_of_seconds(std::numeric_limits<double>::infinity()), kForever);
  EXPECT_EQ(dtrain::util::capped(milliseconds::max()), kForever);
  EXPECT_EQ(dtrain::util::capped(milliseconds(5)), milliseconds(5));
  const auto now = std::chrono::steady_clock::now();
  EXPECT_GT(now + dtrain::util::capped(milliseconds::max()), now);
}

// The wildcard addresses, whichever way they are spelled, and nothing else (names are not resolved).
TEST(Env, WildcardAddressesAreRecognized) {
  for (const char* a : {"0.0.0.0", "0", "::", "[::]", "0:0::0", "::0"})
    EXPECT_TRUE(dtrain::util::is_wildcard_address(a)) << a;
  for (const char* a : {"127.0.0.1", "::1", "localhost", "node0.example", "10.0.0.0", ""})
    EXPECT_FALSE(dtrain::util::is_wildcard_address(a)) << a;
}

// One line naming the variable, the value and what is allowed; the texts that tests and the
// troubleshooting guide match elsewhere are spelled out in full.
TEST(Env, BadValuesNameTheVariableTheValueAndWhatIsAllowed) {
  auto err = [](const std::function<void(const env::Lookup&)>& read, const char* name, const char* value) {
    const std::string e = error_of([&] { read(vars({{name, value}})); });
    EXPECT_THAT(e, Not(HasSubstr("\n")));
    return e;
  };
  auto choice = [](const char* n) { return [n](const env::Lookup& v) { env::choice(n, v); }; };
  EXPECT_EQ(err(choice("DTRAIN_SHM"), "DTRAIN_SHM", "yes"),
            "DTRAIN_SHM='yes' is invalid: use 0 (Gloo only), 1 (require shared memory) or leave it unset "
            "(shared memory where ranks share a host)");
  EXPECT_EQ(err(choice("DTRAIN_BACKEND"), "DTRAIN_BACKEND", "mpi"),
            "DTRAIN_BACKEND='mpi' is invalid: use gloo (CPU tensors) or nccl (CUDA tensors, CUDA builds)");
  EXPECT_EQ(err(choice("DTRAIN_DEBUG"), "DTRAIN_DEBUG", "LOUD"),
            "DTRAIN_DEBUG=LOUD is not a debug level: use OFF, INFO or DETAIL");
  EXPECT_EQ(err([](const env::Lookup& v) { env::flag("DTRAIN_PYTORCH_PEERS", v); }, "DTRAIN_PYTORCH_PEERS", "true"),
            "DTRAIN_PYTORCH_PEERS='true' is invalid: use 1 (some ranks are Python programs) or 0");
  for (const char* bad : {"4100", "4032", "268435520", "1e6", "x"})
    EXPECT_EQ(err([](const env::Lookup& v) { env::integer("DTRAIN_SHM_SLOT_BYTES", v); }, "DTRAIN_SHM_SLOT_BYTES", bad),
              std::string("DTRAIN_SHM_SLOT_BYTES='") + bad + "' is not a multiple of 64 between 4096 and 268435456");
  EXPECT_EQ(err([](const env::Lookup& v) { env::integer("RANK", v, "start it with dtrain-run"); }, "RANK", "-1"),
            "RANK='-1' is not a non-negative integer: start it with dtrain-run");
  EXPECT_EQ(err([](const env::Lookup& v) { env::integer("DTRAIN_RESTART_COUNT", v); }, "DTRAIN_RESTART_COUNT", "x"),
            "DTRAIN_RESTART_COUNT='x' is not a non-negative integer: it is set by dtrain-run");
  for (const char* bad : {"0", "-1", "abc", "inf", "nan", "5s"})
    EXPECT_EQ(err([](const env::Lookup& v) { env::seconds("DTRAIN_TIMEOUT_S", v); }, "DTRAIN_TIMEOUT_S", bad),
              std::string("DTRAIN_TIMEOUT_S='") + bad + "' is not a positive number of seconds");
  for (const char* bad : {"0", "65536", "http", "-1"})
    EXPECT_EQ(err([](const env::Lookup& v) { env::port("MASTER_PORT", v); }, "MASTER_PORT", bad),
              std::string("MASTER_PORT='") + bad +
                  "' is not a valid port: use a number from 1 to 65535 (29500 is PyTorch's default)");
  EXPECT_EQ(err([](const env::Lookup& v) { env::host("MASTER_ADDR", v); }, "MASTER_ADDR", "a b"),
            "MASTER_ADDR='a b' is not a host name or address: use e.g. 127.0.0.1 or node0.example");
}

TEST(Env, ReadingAVariableOutsideTheTableOrAsAnotherTypeIsABug) {
  EXPECT_THAT(error_of([] { env::text("DTRAIN_NO_SUCH_KNOB"); }), HasSubstr("has no row"));
  EXPECT_THAT(error_of([] { env::integer("DTRAIN_SHM"); }), HasSubstr("internal error"));
  EXPECT_THAT(error_of([] { env::flag("DTRAIN_DEBUG"); }), HasSubstr("internal error"));
}

// Rows the docs can show and the accessors can honour: unique names, a meaning, and a fallback that
// passes the row's own validation.
TEST(Env, EveryRowIsWellFormed) {
  std::set<std::string> names;
  for (const env::Knob& k : env::knobs()) {
    SCOPED_TRACE(k.name);
    EXPECT_TRUE(names.insert(k.name).second) << "two rows";
    EXPECT_NE(std::string(k.meaning), "");
    EXPECT_NE(std::string(k.allowed), "");
    for (const char* cell : {k.name, k.fallback, k.allowed, k.remedy, k.meaning})
      EXPECT_EQ(std::string(cell).find_first_of("|\n"), std::string::npos) << "breaks the markdown table: " << cell;
    if (k.reader == env::Reader::kNobody) continue;
    EXPECT_NO_THROW(read_as_its_type(k, vars({}))) << "the fallback fails its own validation";
  }
}

TEST(Env, DocsShowExactlyTheTable) {
  const std::string doc = read_file(kRoot / "docs/environment.md");
  const std::string begin = "<!-- env-table:begin -->\n", end = "<!-- env-table:end -->";
  const auto b = doc.find(begin), e = doc.find(end);
  ASSERT_TRUE(b != std::string::npos && e != std::string::npos && b < e)
      << "docs/environment.md needs the markers " << begin << " and " << end;
  EXPECT_EQ(doc.substr(b + begin.size(), e - b - begin.size()), env::markdown_tables())
      << "docs/environment.md's tables differ from src/common/env.cpp's: replace the lines between the "
         "env-table markers with the output of `env_test --print-tables`";
}

TEST(Env, EveryDtrainNameInTheSourcesIsARow) {
  std::set<std::string> rows;
  for (const env::Knob& k : env::knobs()) rows.insert(k.name);
  // Compile-time names are no environment variables: macros #define'd in the sources, the C API's
  // enumerators (its status codes and ops, `DTRAIN_C_OK = 0,`), and the definitions CMake passes
  // (target_compile_definitions).
  std::set<std::string> macros;
  const std::regex name(R"(\bDTRAIN_[A-Z0-9_]+\b)"), define(R"(#\s*define\s+(DTRAIN_[A-Z0-9_]+))"),
      enumerator(R"(\b(DTRAIN_C_[A-Z0-9_]+)\s*=\s*-?[0-9])"), cmake_defs(R"(target_compile_definitions\(([^)]*)\))");
  const auto files = sources();
  for (const auto& f : files) {
    const std::string text = read_file(f);
    for (const std::regex* r : {&define, &enumerator})
      for (std::sregex_iterator m(text.begin(), text.end(), *r), end; m != end; ++m) macros.insert((*m)[1]);
  }
  std::vector<fs::path> cmake_files{kRoot / "CMakeLists.txt"};
  for (const char* dir : {"src", "tools"})
    for (const auto& e : fs::recursive_directory_iterator(kRoot / dir))
      if (e.path().filename() == "CMakeLists.txt") cmake_files.push_back(e.path());
  for (const auto& path : cmake_files) {
    const std::string text = read_file(path);
    for (std::sregex_iterator m(text.begin(), text.end(), cmake_defs), end; m != end; ++m) {
      const std::string args = (*m)[1];
      for (std::sregex_iterator n(args.begin(), args.end(), name); n != end; ++n) macros.insert(n->str());
    }
  }
  ASSERT_TRUE(macros.count("DTRAIN_CHECK") && macros.count("DTRAIN_WITH_CUDA")) << "the scan finds the macros";
  std::set<std::string> seen;
  for (const auto& f : files) {
    std::istringstream in(read_file(f));
    int lineno = 0;
    for (std::string line; std::getline(in, line);) {
      ++lineno;
      for (std::sregex_iterator m(line.begin(), line.end(), name), end; m != end; ++m) {
        seen.insert(m->str());
        EXPECT_TRUE(rows.count(m->str()) || macros.count(m->str()))
            << fs::relative(f, kRoot).string() << ":" << lineno << ": " << m->str()
            << " is no row of src/common/env.cpp's table and no macro: add it to the table (and run "
               "`env_test --print-tables` for docs/environment.md)";
      }
    }
  }
  EXPECT_TRUE(seen.count("DTRAIN_SHM") && seen.count("DTRAIN_RUN_RDZV_REPORT_S")) << "the scan reads src/ and tools/";
}

TEST(Env, OnlyEnvCppReadsTheEnvironment) {
  const std::regex access(R"(\b(getenv|secure_getenv|setenv|unsetenv|putenv|environ)\b)");
  const fs::path allowed = kRoot / "src/common/env.cpp";
  for (const auto& f : sources()) {
    if (f == allowed) continue;
    std::istringstream in(read_file(f));
    int lineno = 0;
    for (std::string line; std::getline(in, line);) {
      ++lineno;
      const std::string code = without_line_comments(line);
      EXPECT_FALSE(std::regex_search(code, access))
          << fs::relative(f, kRoot).string() << ":" << lineno << ": " << line
          << "\n  reads the environment itself: give the variable a row in src/common/env.cpp and use its accessor";
    }
  }
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--print-tables") {
    std::cout << env::markdown_tables();
    return 0;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
