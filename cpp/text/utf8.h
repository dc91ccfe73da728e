// UTF-8's well-formed byte sequences (RFC 3629; the Unicode Standard's Table
// 3-7): what a lead byte starts, and the range its second byte must be in.
#pragma once

#include <cstdint>

namespace cellcache::runner {

struct Utf8Lead {
  int length = 0;     // bytes of the character: 1-4; 0 = the byte starts none
  uint8_t lo = 0x80;  // the second byte's range (later bytes: 0x80-0xBF)
  uint8_t hi = 0xBF;
};

constexpr Utf8Lead utf8_lead(uint8_t b) {
  if (b < 0x80) return {1, 0x80, 0xBF};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};                    // no overlong forms
  if (b == 0xED) return {3, 0x80, 0x9F};                    // no surrogates
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};                    // no overlong forms
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};                    // nothing past U+10FFFF
  return {};
}

}  // namespace cellcache::runner
