// Formats and throws moe::Error. The message leads with what went wrong; file:line and the
// failed expression follow for whoever debugs it.
#include "core/error.h"

#include <cstring>

namespace moe::detail {

void throw_error(const char* file, int line, const char* expr, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  std::ostringstream os;
  os << (msg.empty() ? std::string("check failed") : msg) << " [" << (base ? base + 1 : file)
     << ":" << line;
  if (expr) os << ", check: " << expr;
  os << "]";
  throw Error(os.str());
}

}  // namespace moe::detail
