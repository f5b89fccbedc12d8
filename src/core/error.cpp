// Formats and throws moe::Error. The message leads with what went wrong; file:line and the
// failed expression follow for whoever debugs it (MOECORE_DEBUG=1, or always for throw_error).
#include "core/error.h"

#include <cstdlib>
#include <cstring>

namespace moe::detail {

namespace {

std::string with_site(const char* file, int line, const char* expr, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  std::ostringstream os;
  os << (msg.empty() ? std::string("check failed") : msg) << " [" << (base ? base + 1 : file) << ":" << line;
  if (expr) os << ", check: " << expr;
  os << "]";
  return os.str();
}

}  // namespace

bool debug_messages() {
  const char* v = std::getenv("MOECORE_DEBUG");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

void throw_check(const char* file, int line, const char* expr, const std::string& msg) {
  if (msg.empty() || debug_messages()) throw Error(with_site(file, line, expr, msg));
  throw Error(msg);
}

void throw_error(const char* file, int line, const char* expr, const std::string& msg) {
  throw Error(with_site(file, line, expr, msg));
}

}  // namespace moe::detail
