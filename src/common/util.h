// Small helpers that every part of dtrain, its tests, benchmarks and the launcher share: whole files,
// the monotonic clock, the host name, and splitting and joining text. Torch-free (the static library
// dtrain_util), so dtrain-run links it too; examples/ stay on the public API and do not use it.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace dtrain::util {

// The whole file, bytes as they are. Throws dtrain::Error "cannot open <what> <path>: <reason>" (or
// "cannot read ...").
std::string read_file(const std::string& path, const std::string& what = "file");

// `path` as a folder of this user's own, made (mode 0755) if missing, for a fixed name in a folder
// every user shares (/tmp/dtrain-flight-<uid>): another user who made that name first, or planted a
// link there, would otherwise receive what this process writes, or block it with a FIFO. Throws
// dtrain::Error "<what> <path> is not this user's own folder (...): remove it, or <remedy>" unless
// it is a folder, not a link, owned by this user and writable by no one else.
//   util::make_own_folder("/tmp/dtrain-flight-1000", "the flight-record folder", "set DTRAIN_FLIGHT_DIR");
void make_own_folder(const std::string& path, const std::string& what, const std::string& remedy);

// fopen(path, "wb") that never writes through a symbolic link: a link planted at the name (in an
// output folder others can write) would otherwise send what this process writes to wherever it
// points. Created with mode 0644 (less the umask) or truncated; nullptr with errno set on failure
// (ELOOP for a link).
//   std::FILE* f = util::create_file(dir + "/metrics.jsonl");
std::FILE* create_file(const std::string& path);

// Nanoseconds on the monotonic clock (std::chrono::steady_clock): for intervals and ordering within a
// process, not comparable between machines.
int64_t now_ns();

// The longest wait dtrain keeps: 10^9 s, about 31.7 years, which is "forever" to a job. A deadline
// this far ahead still fits steady_clock's int64 nanoseconds (292 years); milliseconds::max() or
// INT64_MAX ms added to now() would overflow into the past and time out at once.
constexpr std::chrono::milliseconds kForever{int64_t{1000000000} * 1000};

// min(d, kForever): a caller's milliseconds::max() means forever, not an overflow.
std::chrono::milliseconds capped(std::chrono::milliseconds d);

// `seconds` (>= 0, not NaN: the callers' parsers refuse those) as milliseconds, rounded up so that
// 0.0001 s waits 1 ms rather than 0 (no wait at all); +inf and anything past kForever is kForever.
std::chrono::milliseconds millis_of_seconds(double seconds);

// This machine's host name; "unknown-host" when it has none.
std::string host_name();

// The pieces of s between separators; as std::getline, a trailing separator ends the last piece
// rather than starting an empty one ("a\nb\n" -> {"a", "b"}; "" -> {}).
std::vector<std::string> split(const std::string& s, char sep = '\n');
// parts with sep between them ("" for none).
std::string join(const std::vector<std::string>& parts, const std::string& sep);

// s on one line, for a message: newlines become spaces, trailing spaces and newlines go.
std::string one_line(std::string s);

// Whether host is a numeric wildcard address (0.0.0.0, 0, ::, 0:0::0, [::]): one that every
// interface answers, so a store bound there is open to every network the machine is on, and a
// client given it reaches whichever local listener answers first. Host names are not resolved.
bool is_wildcard_address(const std::string& host);

// Whether s is a non-empty run of the digits 0-9 (no sign, no spaces).
bool is_digits(const std::string& s);

}  // namespace dtrain::util
