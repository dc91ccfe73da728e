#include "prompts_file.h"

#include "tokenizer.h"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace cellcache::runner {
namespace {

// Parses one line; an empty result is a blank line.
Outcome<std::vector<int64_t>> parse_line(const std::string& line, const std::string& where) {
  std::vector<int64_t> tokens;
  std::istringstream words(line);
  std::string word;
  while (words >> word) {
    int64_t token = 0;
    const char* end = word.data() + word.size();
    const auto [ptr, ec] = std::from_chars(word.data(), end, token);
    if (ec != std::errc() || ptr != end) {
      return user_error(where + ": '" + word + "' is not an integer token id");
    }
    tokens.push_back(token);
  }
  return tokens;
}

}  // namespace

Outcome<std::vector<std::vector<int64_t>>> read_prompts_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return user_error("prompts file '" + path + "' does not exist or is not a file");
  }
  std::ifstream in(path);
  if (!in) return user_error("cannot read prompts file '" + path + "'");
  std::vector<std::vector<int64_t>> prompts;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    auto tokens = parse_line(line, path + " line " + std::to_string(line_no));
    if (!tokens.ok()) return tokens.error();
    if (!tokens.value().empty()) prompts.push_back(std::move(tokens.value()));
  }
  if (in.bad()) return user_error("cannot read prompts file '" + path + "'");
  if (prompts.empty()) return user_error("prompts file '" + path + "' holds no prompt");
  return prompts;
}

Outcome<std::vector<std::string>> read_text_prompts_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return user_error("prompts file '" + path + "' does not exist or is not a file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return user_error("cannot read prompts file '" + path + "'");
  std::vector<std::string> prompts;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line_no == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);  // a BOM
    auto utf8 = check_utf8(line, path + " line " + std::to_string(line_no));
    if (!utf8.ok()) return utf8.error();
    if (line.find_first_not_of(" \t") != std::string::npos) prompts.push_back(line);
  }
  if (in.bad()) return user_error("cannot read prompts file '" + path + "'");
  if (prompts.empty()) return user_error("prompts file '" + path + "' holds no prompt");
  return prompts;
}

}  // namespace cellcache::runner
