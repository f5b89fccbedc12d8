// One command-line parser for every subcommand. A command declares its positionals and options
// (CommandSpec); parse_args accepts `--name=value` and `--name value` alike, for options and for
// `--section.key` config overrides, `-h` / `--help`, and `--` before positionals that start with
// a dash. Every mistake is a UsageError saying which argument is wrong and why (unknown option
// with the nearest name, missing value, missing or extra positionals).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace moe::cli {

// A mistake in the command line; main prints it with the command's usage line.
class UsageError : public Error {
 public:
  using Error::Error;
};

struct OptionSpec {
  std::string name;        // "--warmup"
  std::string value_name;  // "N"; empty: a switch that takes no value
  std::string help;        // one line for --help
  bool required = false;   // parse_args refuses a command line without it
  std::string short_name = {};  // "-o": also accepted as `-o VALUE` (never -oVALUE); empty: none
};

struct CommandSpec {
  std::string name;                      // "bench"
  std::vector<std::string> positionals;  // "CHECKPOINT_DIR", "OUT_DIR"; the last may end in "..."
  size_t min_positionals = 0;            // the first min_positionals are required
  bool overrides = false;                // accepts --section.key=value config overrides
  std::vector<OptionSpec> options;       // -h / --help is implied
  std::string description;               // paragraphs shown by --help after the usage line
};

struct ParsedArgs {
  bool help = false;
  std::vector<std::string> positionals;
  std::vector<std::string> overrides;  // each as "--section.key=value", in command-line order
  std::map<std::string, std::string> values;  // option name -> value (the last one given); "" for a switch

  bool has(const std::string& name) const { return values.count(name) != 0; }
  std::optional<std::string> value(const std::string& name) const;
  std::string value_or(const std::string& name, const std::string& fallback) const;
  // The option's value as an integer in [lo, hi]; `fallback` when absent. Refusals name the option.
  int64_t int_or(const std::string& name, int64_t fallback, int64_t lo = std::numeric_limits<int64_t>::min(),
                 int64_t hi = std::numeric_limits<int64_t>::max()) const;
};

// Parses the arguments after the command name. Throws UsageError (not for --help: then only
// `help` is set and nothing else is checked).
ParsedArgs parse_args(const CommandSpec& spec, const std::vector<std::string>& args);

// "usage: moecore bench [CONFIG.toml] [--warmup N] ... [--section.key=value ...]"
std::string usage_line(const CommandSpec& spec);
// The usage line, the description and one line per option.
std::string help_text(const CommandSpec& spec);

// `text` as an integer in [lo, hi]; anything else is a UsageError naming `what`.
int64_t parse_int(const std::string& what, const std::string& text,
                  int64_t lo = std::numeric_limits<int64_t>::min(), int64_t hi = std::numeric_limits<int64_t>::max());

// Edit distance (insertions, deletions, substitutions, adjacent swaps), for "did you mean".
int edit_distance(const std::string& a, const std::string& b);

}  // namespace moe::cli
