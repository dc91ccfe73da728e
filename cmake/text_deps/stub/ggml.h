// Stand-in for llama.cpp's ggml.h, used only to compile llama.cpp's common/json.cpp (the
// chat-template engine's JSON wrapper) without ggml: json.cpp needs GGML_ASSERT and nothing else.
#pragma once
#include <cstdio>
#include <cstdlib>
#define GGML_ASSERT(x)                                                          \
  do {                                                                          \
    if (!(x)) {                                                                 \
      std::fprintf(stderr, "%s:%d: GGML_ASSERT(%s) failed\n", __FILE__, __LINE__, #x); \
      std::abort();                                                             \
    }                                                                           \
  } while (0)
