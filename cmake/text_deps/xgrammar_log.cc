// XGrammar's log hooks (it is built with XGRAMMAR_LOG_CUSTOMIZE=1, see
// CMakeLists.txt): nothing goes to an app's stderr. Fatal errors throw
// LogFatalError, as XGrammar's own hooks do; warnings are kept per thread
// for cellcache_xgrammar_warnings.h; info and debug lines are dropped.
#include <string>
#include <utility>
#include <vector>

#include "cellcache_xgrammar_warnings.h"
#include "support/logging.h"

namespace {
thread_local std::vector<std::string> warnings;
}  // namespace

namespace xgrammar {

[[noreturn]] void LogFatalImpl(const std::string& file, int lineno, const std::string& message) {
  throw LogFatalError(file, lineno, message);
}

void LogMessageImpl(const std::string&, int, int level, const std::string& message) {
  if (level == XGRAMMAR_LOG_LEVEL_WARNING && warnings.size() < 64) warnings.push_back(message);
}

}  // namespace xgrammar

namespace cellcache_text_deps {

std::vector<std::string> take_xgrammar_warnings() { return std::exchange(warnings, {}); }

}  // namespace cellcache_text_deps
