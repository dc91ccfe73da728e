#include "stream_decoder.h"

#include "utf8.h"

namespace cellcache::runner {

namespace {
constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD
}

std::string Utf8Stream::push(std::string_view bytes) {
  std::string out;
  for (char c : bytes) feed(static_cast<uint8_t>(c), out);
  return out;
}

std::string Utf8Stream::flush() {
  if (held_.empty()) return "";
  std::string out = kReplacement;
  if (surrogate_) out += kReplacement;
  held_.clear();
  need_ = 0;
  surrogate_ = false;
  return out;
}

void Utf8Stream::feed(uint8_t b, std::string& out) {
  if (surrogate_) {
    // ED A0-BF (a UTF-16 surrogate's first two bytes), held until this byte:
    // now both are errors, as CPython's incremental decoder settles them.
    out += kReplacement;
    out += kReplacement;
    held_.clear();
    surrogate_ = false;
  }
  if (!held_.empty()) {
    if (held_.size() == 1 && static_cast<uint8_t>(held_[0]) == 0xED && b >= 0xA0 && b <= 0xBF) {
      held_.push_back(static_cast<char>(b));
      surrogate_ = true;
      return;
    }
    if (b >= lo_ && b <= hi_) {
      held_.push_back(static_cast<char>(b));
      lo_ = 0x80, hi_ = 0xBF;
      if (static_cast<int>(held_.size()) == need_) {
        out += held_;
        held_.clear();
      }
      return;
    }
    // The held bytes are a maximal invalid subpart: one U+FFFD; b starts anew.
    out += kReplacement;
    held_.clear();
  }
  if (b < 0x80) {
    out.push_back(static_cast<char>(b));
    return;
  }
  const Utf8Lead lead = utf8_lead(b);
  if (lead.length == 0) {
    out += kReplacement;  // a byte that starts no character
    return;
  }
  need_ = lead.length;
  lo_ = lead.lo, hi_ = lead.hi;
  held_.push_back(static_cast<char>(b));
}

}  // namespace cellcache::runner
