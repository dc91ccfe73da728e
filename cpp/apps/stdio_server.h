// The --stdio protocol of cellcache_runner: JSON lines in, JSON lines out, so
// an app in any language drives an Engine (engine.h) through a pipe.
//
// In, one JSON object per line (blank lines are skipped):
//   {"id": "a", "prompt": [0, 340, 344], "max_new_tokens": 16, "n": 1,
//    "temperature": 0, "seed": 1, "top_k": 40, "top_p": 0.9,
//    "stop_token_ids": [2], "stop_on_eos": true, "logprobs": 2,
//    "speculative": false}
//       a request: "id" (a string or an integer, echoed back as given; not
//       one of a live request) and "prompt" (token ids) are required, the
//       rest optional (SamplingParams' defaults: 16 new tokens, n 1, greedy,
//       stop on the program's EOS ids; "speculative": false keeps it out of
//       the engine's speculative decoding); null means absent.
//   {"id": "b", "text": "Once upon a time", ...}
//       the prompt as text instead of ids: encoded by the program's own
//       tokenizer (tokenizer.h) with its special tokens (BOS), as Python's
//       tokenizer.encode(text) does.
//   {"id": "c", "messages": [{"role": "user", "content": "Hi"}],
//    "tools": [...], "chat_template_kwargs": {...}, ...}
//       a chat: rendered by the program's chat template (chat_template.h;
//       "tools" in OpenAI's form, for the template to show), then encoded.
//       Roles: system, developer, user, assistant, tool; "content" a string,
//       null (""), or OpenAI's text parts (joined), as the Python server takes
//       it; an assistant message may carry "tool_calls" and a tool message
//       "tool_call_id" (OpenAI's form; a finish line's "tool_calls" is it).
//       "tool_choice": "none" | "auto" (the default with tools) | "required"
//       | {"type": "function", "function": {"name": N}}, and
//       "parallel_tool_calls" (default true), as OpenAI's (tool_calls.h):
//       "auto" lets the reply run free until the format's trigger (chosen
//       from the chat template: hermes <tool_call> or llama3_json), then
//       holds the call to its tool's parameters; "required" / a function
//       force the whole reply to be a call (several, separated by "\n", when
//       "required" and parallel). Not with "json_schema"/"grammar" (under
//       "auto" those constrain the reply and calls are only parsed).
//   "json_schema": {...} (a JSON schema, or its JSON text) or
//   "grammar": "root ::= ..." (GBNF), in any request
//       structured output (grammar.h): every sample's text follows it (as
//       json.dumps writes JSON: ", " and ": ", no free whitespace) and ends,
//       finish "stop", on the token that completes it when nothing else
//       could follow.
//   {"cancel": "a"}
//       ends request "a"'s unfinished samples (finish "cancelled").
// Out, one JSON object per line, flushed after each engine step:
//   {"id": "a", "sample": 0, "token": 123}                  a chosen token
//       (+ "logprob": x, "top_logprobs": [[id, lp], ...] when "logprobs" asked;
//       + "text": the text the token completes, for a "text" or "messages"
//       request: "" while a character waits for its next bytes, nothing for
//       a special token, as the Python server streams it (stream_decoder.h))
//   {"id": "a", "sample": 0, "finish": "stop"|"length"|"cancelled"|"error",
//    "usage": {"prompt_tokens": P, "cached_tokens": C, "completion_tokens": K}}
//       once per sample, after its last token (an engine that speculates adds
//       "proposed_tokens" and "accepted_tokens": the sample's proposals
//       verified and accepted)
//       (a text request's finish line carries "text": "\ufffd" when bytes
//       of an unfinished character were still held; a chat with tools whose
//       reply holds calls finishes "tool_calls" with "content": the text
//       before the first call or null, and "tool_calls": [{"id", "type":
//       "function", "function": {"name", "arguments": JSON text}}, ...], as
//       OpenAI's chat completions give them)
//   {"id": "a", "error": "line N: ..."}                     a line refused
//       (nothing of it runs; "id" is null when none could be read)
// Every accepted request's n samples each end with one finish line; a refused
// line changes nothing and the server goes on with the next one. A request's
// id is free again once its last finish line is out.
//
// Threads: serve_stdio reads `in` on a thread of its own (submits and cancels
// are applied as they arrive) and steps the engine on the calling thread,
// sleeping while there is nothing to do. At the end of the input it finishes
// what was accepted and returns. Nothing throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <istream>
#include <string>
#include <string_view>

#include "chat_template.h"
#include "engine.h"
#include "grammar.h"
#include "grammar_hooks.h"
#include "run_status.h"
#include "tokenizer.h"

namespace cellcache::runner {

// Input lines longer than this are refused (and skipped without being held in
// memory).
constexpr size_t kMaxStdioLineBytes = size_t{4} << 20;

// JSON nested deeper than this is refused (a JSON schema, or a chat's tool
// calls and tool schemas, take the most).
constexpr int kMaxStdioDepth = 64;
// Requests waiting or running at once; more are refused until some finish (a
// client cannot queue unbounded memory).
constexpr size_t kMaxStdioLiveRequests = 4096;

struct StdioOptions {
  size_t max_line_bytes = kMaxStdioLineBytes;
  size_t max_live_requests = kMaxStdioLiveRequests;
  // Text and structured output: the program's tokenizer, chat template and
  // grammar compiler, and the engine's hooks (EngineOptions::hooks); null
  // when the program has none: a request that needs one is refused with
  // text_unavailable / grammar_unavailable (why: Tokenizer::create's error).
  const Tokenizer* tokenizer = nullptr;
  const ChatTemplate* chat_template = nullptr;
  const GrammarCompiler* grammar_compiler = nullptr;
  GrammarHooks* grammar_hooks = nullptr;
  std::string text_unavailable = "this runner was given none";
  std::string grammar_unavailable = "this runner was given no grammar compiler";
  // Diagnostics that are no client's answer (a failed step, a closed
  // output), one line each without '\n'; unset = dropped.
  std::function<void(const std::string&)> log;
};

// Receives output: whole lines, each ending in '\n', a step's worth (or one
// error line) at a time; writes and flushes them. Returns false when the
// output is gone (a closed pipe): serve_stdio then cancels what runs, accepts
// nothing more and, at the end of the input, returns a runtime error.
using StdioOutput = std::function<bool(std::string_view lines)>;

struct StdioSummary {
  int64_t lines = 0;              // input lines read (blank ones included)
  int64_t requests = 0;           // requests accepted
  int64_t refused = 0;            // lines answered with an error
  int64_t prompt_tokens = 0;      // over finished requests
  int64_t cached_tokens = 0;      // of those, served from the prefix cache
  int64_t completion_tokens = 0;  // every sample's tokens
  int64_t failed_steps = 0;       // steps whose forward failed (requests ended "error")
};

// Serves `engine` (stepped only here; it must not be stepped elsewhere
// meanwhile) until `in` ends and every accepted request has finished.
// Runtime error: the output failed.
Outcome<StdioSummary> serve_stdio(Engine& engine, std::istream& in, const StdioOutput& out,
                                  const StdioOptions& options = {});

}  // namespace cellcache::runner
