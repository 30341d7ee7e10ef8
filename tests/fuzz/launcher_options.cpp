// Fuzz target: dtrain-run's command line (tools/dtrain-run/options.h). The input is split into argv
// words at NUL bytes and newlines, after "dtrain-run" as argv[0]. parse_options never exits: a bad
// command line is a UsageError, --help / --version a HelpRequested (main prints them and exits), so
// both are expected here; a crash, a leak or undefined behaviour is a finding. The program named is
// only looked up in PATH (stat), never started.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "options.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> words{"dtrain-run"};
  std::string word;
  for (size_t i = 0; i <= size; ++i) {
    if (i == size || data[i] == '\0' || data[i] == '\n') {
      words.push_back(word);
      word.clear();
      if (words.size() > 64) break;  // longer command lines find nothing new, only take time
    } else {
      word += static_cast<char>(data[i]);
    }
  }
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  try {
    (void)dtrain::run::parse_options(static_cast<int>(words.size()), argv.data());
  } catch (const dtrain::run::UsageError&) {
  } catch (const dtrain::run::HelpRequested&) {
  } catch (const std::exception&) {  // dtrain::Error of the Slurm step's checks (the environment)
  }
  return 0;
}
