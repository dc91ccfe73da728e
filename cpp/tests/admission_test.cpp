// Core tests: the admission arithmetic (cellcache/admission.h), values worked
// out by hand from the rule P - C + n * (M - 1).
#include <string>

#include "cellcache/admission.h"
#include "check.h"

using namespace cellcache;

TEST(worst_case_cells_counts_the_prompt_once_and_each_sample_but_its_last_token) {
  CHECK_EQ(request_worst_case_cells(5, 0, 1, 252), 256);  // 5 + 251
  CHECK_EQ(request_worst_case_cells(13, 0, 3, 83), 259);  // 13 + 3 * 82
  CHECK_EQ(request_worst_case_cells(13, 8, 3, 83), 251);  // 8 prompt tokens cloned
  CHECK_EQ(request_worst_case_cells(7, 0, 4, 1), 7);      // one new token each: none fed back
}

TEST(request_fits_up_to_the_capacity_and_the_sequence_ids) {
  CHECK(check_request_fits("prompt 0", 5, 1, 252, 256).is_ok());
  const Status over = check_request_fits("prompt 1", 13, 3, 83, 256);
  CHECK(over.code() == StatusCode::kCapacity);
  CHECK(over.message().starts_with("prompt 1 needs up to 259 cells (13 prompt tokens + n=3 "
                                   "samples x 82 generated tokens fed back) but the cache "
                                   "has 256"));
  const Status prompt = check_request_fits("prompt 2", 257, 1, 1, 256);
  CHECK(prompt.code() == StatusCode::kCapacity);
  CHECK(prompt.message() == "prompt 2's prompt alone is 257 tokens but the cache has 256 cells; "
                            "shorten it, or export with more cells (--cells)");
  CHECK(check_request_fits("prompt 3", 256, 1, 1, 256).is_ok());
  CHECK(check_request_fits("r", 1, kMaxSequences, 1, 1).is_ok());
  const Status ids = check_request_fits("r", 1, kMaxSequences + 1, 1, 1);
  CHECK(ids.code() == StatusCode::kCapacity);
  CHECK(ids.message() == "n=" + std::to_string(kMaxSequences + 1) + " samples exceed the " +
                             std::to_string(kMaxSequences) + " sequence ids");
}
