// The command-line parser of every subcommand (args.h). Arguments are read left to right: `--`
// ends the options; `--name=value` splits at the first '='; `--name` takes the next argument as
// its value when the option (or a dotted config override) needs one, unless that argument is
// itself an option (a value starting with "--" is written `--name=--value`).
#include "cli/args.h"

#include <algorithm>
#include <charconv>
#include <climits>

#include "core/config_io.h"

namespace moe::cli {

namespace {

template <typename... Parts>
[[noreturn]] void usage_fail(const Parts&... parts) {
  throw UsageError(detail::concat(parts...));
}

const OptionSpec* find_option(const CommandSpec& spec, const std::string& name) {
  for (const OptionSpec& o : spec.options)
    if (o.name == name) return &o;
  return nullptr;
}

bool repeats(const std::string& positional) {
  return positional.size() > 3 && positional.compare(positional.size() - 3, 3, "...") == 0;
}

// "unknown option '--stpes' for `moecore bench`", with the nearest option or config key.
[[noreturn]] void unknown_option(const CommandSpec& spec, const std::string& name) {
  std::string best;
  int best_d = INT_MAX;
  for (const std::string& candidate : [&] {
         std::vector<std::string> names = {"--help"};
         for (const OptionSpec& o : spec.options) names.push_back(o.name);
         return names;
       }()) {
    const int d = edit_distance(name, candidate);
    if (d < best_d) best_d = d, best = candidate;
  }
  std::string hint;
  if (best_d <= std::max<int>(2, int(name.size()) / 3)) {
    hint = "; did you mean '" + best + "'?";
  } else if (spec.overrides) {
    const std::string key = nearest_key(name.substr(2));
    if (!key.empty()) hint = "; did you mean the config key '--" + key + "'?";
  }
  if (hint.empty()) hint = " (`moecore " + spec.name + " --help` lists its options)";
  usage_fail("unknown option '", name, "' for `moecore ", spec.name, "`", hint);
}

}  // namespace

std::optional<std::string> ParsedArgs::value(const std::string& name) const {
  auto it = values.find(name);
  if (it == values.end()) return std::nullopt;
  return it->second;
}

std::string ParsedArgs::value_or(const std::string& name, const std::string& fallback) const {
  auto it = values.find(name);
  return it == values.end() ? fallback : it->second;
}

int64_t ParsedArgs::int_or(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const {
  auto it = values.find(name);
  return it == values.end() ? fallback : parse_int(name, it->second, lo, hi);
}

int edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = int(i);
  for (size_t j = 0; j <= m; ++j) d[0][j] = int(j);
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

int64_t parse_int(const std::string& what, const std::string& text, int64_t lo, int64_t hi) {
  std::string_view s = text;
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec == std::errc::result_out_of_range)
    usage_fail(what, ": ", text, " is out of range (expected an integer in [", lo, ", ", hi, "])");
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size())
    usage_fail(what, ": expected an integer, got '", text, "'");
  if (v < lo || v > hi) usage_fail(what, ": expected an integer in [", lo, ", ", hi, "], got ", v);
  return v;
}

ParsedArgs parse_args(const CommandSpec& spec, const std::vector<std::string>& args) {
  ParsedArgs out;
  for (const std::string& a : args)
    if (a == "--") break;
    else if (a == "-h" || a == "--help") {
      out.help = true;
      return out;
    }
  bool options_done = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (options_done || a.size() < 2 || a[0] != '-') {
      out.positionals.push_back(a);
      continue;
    }
    if (a == "--") {
      options_done = true;
      continue;
    }
    const OptionSpec* short_opt = nullptr;
    if (a[1] != '-') {
      for (const OptionSpec& o : spec.options)
        if (!o.short_name.empty() && o.short_name == a) short_opt = &o;
      if (short_opt == nullptr)
        usage_fail("unknown option '", a, "' for `moecore ", spec.name, "` (options are spelt --name)");
    }
    const size_t eq = short_opt ? std::string::npos : a.find('=');
    const std::string name = short_opt ? short_opt->name : a.substr(0, eq);
    const bool is_override = name.find('.') != std::string::npos;
    const OptionSpec* opt = is_override ? nullptr : find_option(spec, name);
    if (is_override && !spec.overrides)
      usage_fail("`moecore ", spec.name, "` takes no config overrides, got '", a, "'");
    if (!is_override && opt == nullptr) unknown_option(spec, name);
    const bool needs_value = is_override || !opt->value_name.empty();
    std::string value;
    if (eq != std::string::npos) {
      if (!needs_value) usage_fail(name, " takes no value, got '", a, "'");
      value = a.substr(eq + 1);
    } else if (needs_value) {
      if (i + 1 >= args.size())
      {
        const std::string v = is_override ? "VALUE" : opt->value_name;
        usage_fail(name, " needs a value: give ", name, "=", v, " or ", name, " ", v);
      }
      const std::string& next = args[i + 1];
      if (next.rfind("--", 0) == 0 && next.size() > 2)
        usage_fail(name, " needs a value, but the next argument is the option '", next, "'; for a value that ",
                   "starts with --, write ", name, "=", next);
      value = args[++i];
    }
    if (is_override)
      out.overrides.push_back(name + "=" + value);
    else
      out.values[name] = value;
  }
  std::string names, given;
  for (const std::string& p : spec.positionals) names += (names.empty() ? "" : " ") + p;
  for (const std::string& p : out.positionals) given += (given.empty() ? "'" : ", '") + p + "'";
  const size_t max = !spec.positionals.empty() && repeats(spec.positionals.back()) ? SIZE_MAX : spec.positionals.size();
  if (out.positionals.size() < spec.min_positionals) {
    const std::string& missing = spec.positionals[out.positionals.size()];
    usage_fail("missing ", missing, repeats(missing) ? " (one or more)" : "", ": `moecore ", spec.name, "` takes ",
               names, given.empty() ? ", got none" : ", got only " + given);
  }
  if (out.positionals.size() > max) {
    if (max == 0)
      usage_fail("unexpected argument '", out.positionals[0], "': `moecore ", spec.name,
                 "` takes no positional arguments");
    usage_fail("unexpected argument '", out.positionals[max], "': `moecore ", spec.name, "` takes ", names, ", got ",
               given);
  }
  for (const OptionSpec& o : spec.options)
    if (o.required && !out.has(o.name))
      usage_fail("missing ", o.name, " ", o.value_name, ": `moecore ", spec.name, "` needs it (", o.help, ")");
  return out;
}

std::string usage_line(const CommandSpec& spec) {
  std::string s = "usage: moecore " + spec.name;
  // One word of the line; `optional` ones in brackets.
  auto word = [&s](const std::string& name, const std::string& value, bool optional) {
    s.append(optional ? " [" : " ").append(name);
    if (!value.empty()) s.append(" ").append(value);
    if (optional) s.append("]");
  };
  for (size_t i = 0; i < spec.positionals.size(); ++i) word(spec.positionals[i], "", i >= spec.min_positionals);
  auto names = [](const OptionSpec& o) { return o.short_name.empty() ? o.name : o.short_name + "|" + o.name; };
  for (const OptionSpec& o : spec.options)
    if (o.required) word(names(o), o.value_name, false);
  for (const OptionSpec& o : spec.options)
    if (!o.required) word(names(o), o.value_name, true);
  if (spec.overrides) word("--section.key=value ...", "", true);
  return s;
}

std::string help_text(const CommandSpec& spec) {
  std::string s = usage_line(spec) + "\n";
  if (!spec.description.empty()) s += "\n" + spec.description;
  if (!s.empty() && s.back() != '\n') s += "\n";
  s += "\noptions (each also as --name=value):\n";
  size_t w = 10;
  auto left_of = [](const OptionSpec& o) {
    return (o.short_name.empty() ? "" : o.short_name + ", ") + o.name + (o.value_name.empty() ? "" : " " + o.value_name);
  };
  for (const OptionSpec& o : spec.options) w = std::max(w, left_of(o).size());
  auto row = [&](const std::string& left, const std::string& help) {
    s += "  " + left + std::string(w + 2 - std::min(w + 2, left.size()), ' ') + help + "\n";
  };
  for (const OptionSpec& o : spec.options) row(left_of(o), o.help);
  row("-h, --help", "print this help");
  if (spec.overrides)
    s += "  --section.key=value   any config key (also --section.key value); `moecore train --help` lists them\n";
  return s;
}

}  // namespace moe::cli
