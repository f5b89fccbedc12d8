// Typed JSON field reads with messages naming file and field (json_fields.h).
#include "checkpoint/json_fields.h"

#include <cmath>

#include "core/error.h"

namespace moe {

using nlohmann::json;

std::string describe_json(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return std::string("the boolean ") + (v.get<bool>() ? "true" : "false");
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "the integer " + v.dump();
    case json::value_t::number_float:
      return "the number " + v.dump();
    case json::value_t::string: {
      const std::string& s = v.get_ref<const std::string&>();
      return "the string " + json(s.size() > 64 ? s.substr(0, 64) + "..." : s).dump(-1, ' ', false,
                                                                                      json::error_handler_t::replace);
    }
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return v.type_name();
  }
}

void require_json_object(const json& j, const std::string& file) {
  MOE_CHECK(j.is_object(), "'", file, "' must hold a JSON object, got ", describe_json(j));
}

namespace {

// The field, or nullptr when absent or null.
const json* field(const json& obj, const std::string& key, const std::string& file) {
  require_json_object(obj, file);
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string bound(int64_t v) {
  if (v == std::numeric_limits<int64_t>::max()) return "2^63 - 1";
  if (v == std::numeric_limits<int64_t>::min()) return "-2^63";
  if (v > 0 && (v & (v - 1)) == 0) return "2^" + std::to_string(__builtin_ctzll(uint64_t(v)));
  return std::to_string(v);
}

}  // namespace

std::optional<int64_t> json_int(const json& obj, const std::string& key, const std::string& file, int64_t lo,
                                int64_t hi) {
  const json* v = field(obj, key, file);
  if (!v) return std::nullopt;
  const std::string expected = "an integer in [" + bound(lo) + ", " + bound(hi) + "]";
  bool ok = false;
  int64_t out = 0;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    ok = u <= uint64_t(std::numeric_limits<int64_t>::max());
    out = ok ? int64_t(u) : 0;
  } else if (v->is_number_integer()) {
    ok = true;
    out = v->get<int64_t>();
  }
  MOE_CHECK(ok && out >= lo && out <= hi, "'", file, "': '", key, "' must be ", expected, ", got ", describe_json(*v));
  return out;
}

int64_t json_int_required(const json& obj, const std::string& key, const std::string& file, int64_t lo, int64_t hi) {
  const std::optional<int64_t> v = json_int(obj, key, file, lo, hi);
  MOE_CHECK(v.has_value(), "'", file, "' has no '", key, "' (an integer in [", bound(lo), ", ", bound(hi), "])");
  return *v;
}

std::optional<double> json_number(const json& obj, const std::string& key, const std::string& file) {
  const json* v = field(obj, key, file);
  if (!v) return std::nullopt;
  MOE_CHECK(v->is_number() && std::isfinite(v->get<double>()), "'", file, "': '", key,
            "' must be a finite number, got ", describe_json(*v));
  return v->get<double>();
}

std::optional<bool> json_bool(const json& obj, const std::string& key, const std::string& file) {
  const json* v = field(obj, key, file);
  if (!v) return std::nullopt;
  MOE_CHECK(v->is_boolean(), "'", file, "': '", key, "' must be true or false, got ", describe_json(*v));
  return v->get<bool>();
}

std::optional<std::string> json_string(const json& obj, const std::string& key, const std::string& file) {
  const json* v = field(obj, key, file);
  if (!v) return std::nullopt;
  MOE_CHECK(v->is_string(), "'", file, "': '", key, "' must be a string, got ", describe_json(*v));
  return v->get<std::string>();
}

json parse_json_text(const std::string& text, const std::string& file) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    MOE_FAIL("'", file, "' is not valid JSON: syntax error at byte ", e.byte);
  }
}

}  // namespace moe
