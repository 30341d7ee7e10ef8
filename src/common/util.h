// Small helpers that every part of dtrain, its tests, benchmarks and the launcher share: whole files,
// the monotonic clock, the host name, and splitting and joining text. Torch-free (the static library
// dtrain_util), so dtrain-run links it too; examples/ stay on the public API and do not use it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::util {

// The whole file, bytes as they are. Throws dtrain::Error "cannot open <what> <path>: <reason>" (or
// "cannot read ...").
std::string read_file(const std::string& path, const std::string& what = "file");

// Nanoseconds on the monotonic clock (std::chrono::steady_clock): for intervals and ordering within a
// process, not comparable between machines.
int64_t now_ns();

// This machine's host name; "unknown-host" when it has none.
std::string host_name();

// The pieces of s between separators; as std::getline, a trailing separator ends the last piece
// rather than starting an empty one ("a\nb\n" -> {"a", "b"}; "" -> {}).
std::vector<std::string> split(const std::string& s, char sep = '\n');
// parts with sep between them ("" for none).
std::string join(const std::vector<std::string>& parts, const std::string& sep);

// s on one line, for a message: newlines become spaces, trailing spaces and newlines go.
std::string one_line(std::string s);

// Whether s is a non-empty run of the digits 0-9 (no sign, no spaces).
bool is_digits(const std::string& s);

}  // namespace dtrain::util
