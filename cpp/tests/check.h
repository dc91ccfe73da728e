// A minimal test harness: TEST(name) registers a case, CHECK* record failures
// and keep going, main() runs every case and returns nonzero on any failure.
// (No googletest on the build machines; ctest runs the binary.)
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace cellcache_test {

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

inline int& failures() {
  static int n = 0;
  return n;
}

struct Register {
  Register(const char* name, std::function<void()> body) {
    cases().push_back({name, std::move(body)});
  }
};

inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: FAILED %s\n", file, line, what.c_str());
  ++failures();
}

inline int run_all() {
  int failed_cases = 0;
  for (const Case& c : cases()) {
    const int before = failures();
    c.body();
    const bool ok = failures() == before;
    std::printf("[%s] %s\n", ok ? " OK " : "FAIL", c.name);
    failed_cases += ok ? 0 : 1;
  }
  std::printf("%zu cases, %d failed\n", cases().size(), failed_cases);
  return failed_cases == 0 ? 0 : 1;
}

}  // namespace cellcache_test

#define CC_CONCAT2(a, b) a##b
#define CC_CONCAT(a, b) CC_CONCAT2(a, b)
#define TEST(name)                                                              \
  static void name();                                                           \
  static ::cellcache_test::Register CC_CONCAT(register_, name)(#name, &name);   \
  static void name()

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) ::cellcache_test::fail(__FILE__, __LINE__, "CHECK(" #cond ")"); \
  } while (0)

#define CHECK_EQ(a, b)                                                          \
  do {                                                                          \
    const auto cc_a = (a);                                                     \
    const auto cc_b = (b);                                                     \
    if (!(cc_a == cc_b)) {                                                      \
      ::cellcache_test::fail(__FILE__, __LINE__,                                \
                             "CHECK_EQ(" #a ", " #b "): " + std::to_string(cc_a) + \
                                 " != " + std::to_string(cc_b));                \
    }                                                                           \
  } while (0)
