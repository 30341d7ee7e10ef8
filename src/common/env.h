// The environment variables dtrain reads, in one table, and the only code that reads them.
//
// Every variable that libdtrain or dtrain-run reads is a row of knobs(): its name, who reads it,
// its type, its value when unset, what is allowed and what it means. docs/environment.md shows the
// same rows (markdown_table()); ctest env_test fails when the two differ, when a DTRAIN_* name in
// src/, include/ or tools/ has no row, or when code outside env.cpp reads the environment.
//
// Code reads a variable only through the typed accessors below. Each one checks that the row has its
// type (a mismatch is a dtrain bug) and validates the value: a bad one throws dtrain::Error with one
// line naming the variable, the value and what is allowed. Torch-free, so dtrain-run links it too.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::env {

enum class Type { kFlag, kChoice, kInteger, kSeconds, kPort, kHost, kText, kList };

// Who reads a variable: libdtrain (every program that links dtrain), the launcher, or nobody (the
// DTRAIN_* variables dtrain-run sets only for the programs it starts).
enum class Reader { kLibrary, kLauncher, kNobody };

struct Knob {
  const char* name;
  Reader reader;
  Type type;
  const char* fallback;  // the value an unset (or empty) variable has; "" = none
  // What is allowed, in words: the docs' column and the error's end. For numbers, ports and hosts a
  // noun phrase ("NAME='x' is not <allowed>"); for the other types a list of values
  // ("NAME='x' is invalid: use <allowed>").
  const char* allowed;
  const char* remedy;  // after a number's, port's or host's error ("" = none)
  const char* meaning;
  std::vector<std::string> choices;        // kFlag and kChoice: the accepted spellings
  int64_t min = 0, max = 0, multiple = 1;  // kInteger
};

const std::vector<Knob>& knobs();
// The row of `name`; a name not in the table is a dtrain bug (DTRAIN_ASSERT).
const Knob& knob(const std::string& name);

// Where values come from: the process's environment, or (in unit tests) a map. An empty value counts
// as unset.
using Lookup = std::function<std::optional<std::string>(const std::string&)>;
Lookup process();

// Typed accessors: the validated value, or the row's fallback when the variable is unset (nullopt
// when the row has none). `remedy` replaces the row's where the caller knows more (which launcher
// sets RANK, say).
bool flag(const char* name, const Lookup& from = process());
std::string choice(const char* name, const Lookup& from = process());
std::optional<int64_t> integer(const char* name, const Lookup& from = process(), const std::string& remedy = "");
std::optional<double> seconds(const char* name, const Lookup& from = process());
std::optional<uint16_t> port(const char* name, const Lookup& from = process());
std::optional<std::string> host(const char* name, const Lookup& from = process());
std::optional<std::string> text(const char* name, const Lookup& from = process());
std::vector<std::string> list(const char* name, const Lookup& from = process());  // comma-separated

// A port number from anywhere (MASTER_PORT, the port of a tcp:// URL): `what` names its source.
uint16_t parse_port(const std::string& value, const std::string& what);

// The whole environment, for dtrain-run to hand on to its workers (it adds its own variables).
std::map<std::string, std::string> all_variables();

// docs/environment.md's tables, one per reader.
std::string markdown_tables();

}  // namespace dtrain::env
