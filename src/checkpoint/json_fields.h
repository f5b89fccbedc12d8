// Typed reads of JSON fields. Every refusal names the file, the field, what was expected and
// what was found ("'ck/step_4/train_state.json': 'step' must be an integer in [0, 2^40], got
// the string \"4\""), instead of the library's bare type_error. Absent or null fields give
// nullopt; the caller decides whether a field is required.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace moe {

// A JSON value for a message: "the string \"x\"", "the integer 3", "an array", "an object"...
std::string describe_json(const nlohmann::json& v);

// Throws unless `j` is an object ("'FILE' must hold a JSON object, got an array").
void require_json_object(const nlohmann::json& j, const std::string& file);

// `file` names the source in messages; `obj` must be an object (require_json_object).
std::optional<int64_t> json_int(const nlohmann::json& obj, const std::string& key, const std::string& file,
                                int64_t lo = std::numeric_limits<int64_t>::min(),
                                int64_t hi = std::numeric_limits<int64_t>::max());
std::optional<double> json_number(const nlohmann::json& obj, const std::string& key, const std::string& file);
std::optional<bool> json_bool(const nlohmann::json& obj, const std::string& key, const std::string& file);
std::optional<std::string> json_string(const nlohmann::json& obj, const std::string& key, const std::string& file);

// The same, required: a missing or null field is refused naming it.
int64_t json_int_required(const nlohmann::json& obj, const std::string& key, const std::string& file,
                          int64_t lo = std::numeric_limits<int64_t>::min(),
                          int64_t hi = std::numeric_limits<int64_t>::max());

// Parses `text` (the contents of `file`); malformed JSON is refused naming the file and the
// byte where parsing stopped.
nlohmann::json parse_json_text(const std::string& text, const std::string& file);

}  // namespace moe
