// cellcache_consumer MODEL.pte MAX_NEW_TOKENS TOKEN...: one greedy request
// through the installed engine; prints its new token ids on one line, and on
// stderr how many thread pools the pool executor made.
#include <cellcache/pool_executor.h>
#include <cellcache/runner/engine.h>
#include <cellcache/runner/program.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

using namespace cellcache::runner;

struct Collect : Sink {
  std::vector<int64_t> tokens;
  bool finished = false;
  void on_token(const TokenEvent& event) override { tokens.push_back(event.token); }
  void on_finish(const FinishEvent&) override { finished = true; }
};

static int fail(const RunError& error) {
  std::fprintf(stderr, "error: %s\n", error.message.c_str());
  return error.kind == ErrorKind::kUser ? 2 : 1;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODEL.pte MAX_NEW_TOKENS TOKEN...\n", argv[0]);
    return 2;
  }
  // CELLCACHE_POOL_SPIN_US, read before the runtime's pool exists.
  if (auto error = cellcache::kernels::configure_pool_spin_from_env()) {
    std::fprintf(stderr, "error: %s\n", error->c_str());
    return 2;
  }
  auto program = CellCacheProgram::load(argv[1]);
  if (!program.ok()) return fail(program.error());
  auto engine = Engine::create(*program.value(), {});
  if (!engine.ok()) return fail(engine.error());

  SamplingParams params;  // temperature 0: greedy
  params.max_new_tokens = std::atoi(argv[2]);
  std::vector<int64_t> prompt;
  for (int i = 3; i < argc; ++i) prompt.push_back(std::strtoll(argv[i], nullptr, 10));
  auto sink = std::make_shared<Collect>();
  auto id = engine.value()->submit(prompt, params, sink);
  if (!id.ok()) return fail(id.error());
  while (!sink->finished) {
    auto stepped = engine.value()->step();
    if (!stepped.ok()) return fail(stepped.error());
  }
  for (size_t i = 0; i < sink->tokens.size(); ++i)
    std::printf(i ? " %lld" : "%lld", static_cast<long long>(sink->tokens[i]));
  std::printf("\n");
  std::fprintf(stderr, "pool executor pools: %lld\n",
               static_cast<long long>(cellcache_pool_executor_pools()));
  return 0;
}
