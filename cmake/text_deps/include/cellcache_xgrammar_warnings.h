// XGrammar's warnings, kept instead of printed (cmake/text_deps/xgrammar_log.cc).
// XGrammar warns where it compiles a schema without enforcing part of it
// ("Keyword not is not supported", a oneOf it reads as anyOf, a remote $ref,
// allOf of several schemas); cpp/grammar refuses such a schema with the
// warning as the reason. Errors still throw xgrammar::LogFatalError.
#pragma once

#include <string>
#include <vector>

namespace cellcache_text_deps {

// The warnings XGrammar gave on this thread since the last call, in order.
std::vector<std::string> take_xgrammar_warnings();

}  // namespace cellcache_text_deps
