// The runner's prompts file: one prompt per line, as whitespace-separated
// token ids, e.g. "256 72 101 108 108 111".
//
// Blank (whitespace-only) lines are skipped, as the Python CLI's
// --prompts-file does; prompt indices count the prompts, not the lines. A
// token that is not a decimal integer is a user error naming its line. Token
// ranges are checked later, against the program's vocabulary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "run_status.h"

namespace cellcache::runner {

// User errors: the file is missing or unreadable, a token is not an integer,
// or the file holds no prompt.
Outcome<std::vector<std::vector<int64_t>>> read_prompts_file(const std::string& path);

// The prompts file of --text / --chat: one prompt of text per line (a "\r"
// before the "\n" dropped; blank lines skipped, as above). User errors: as
// above, and a line that is not UTF-8.
Outcome<std::vector<std::string>> read_text_prompts_file(const std::string& path);

}  // namespace cellcache::runner
