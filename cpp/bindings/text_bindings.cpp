// Python faces of the C++ text and grammar layers (cpp/text, cpp/grammar):
// the on-device tokenizer, stream decoder, chat template and grammar
// matcher, so tests compare them with the Python runtime's (tokenizers,
// jinja2) on the same inputs, and the server can use the same grammar engine.
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "binding_util.h"
#include "chat_template.h"
#include "grammar.h"
#include "stream_decoder.h"
#include "tokenizer.h"
#include "tool_calls.h"

namespace cellcache::bindings {

using runner::ChatTemplate;
using runner::GrammarCompiler;
using runner::GrammarMatcher;
using runner::StreamDecoder;
using runner::Tokenizer;
using runner::Utf8Stream;

void bind_text(py::module_& m) {
  py::class_<Tokenizer, std::shared_ptr<Tokenizer>>(m, "CppTokenizer")
      .def(py::init([](const std::string& kind, const std::string& json) {
             return std::shared_ptr<Tokenizer>(unwrap_run(Tokenizer::create(kind, json)));
           }),
           py::arg("kind"), py::arg("json"))
      .def("encode",
           [](const Tokenizer& t, const std::string& text, bool add_special_tokens) {
             return unwrap_run(t.encode(text, add_special_tokens));
           },
           py::arg("text"), py::arg("add_special_tokens") = true)
      .def("token_bytes", [](const Tokenizer& t, int64_t token) {
        return py::bytes(std::string(t.token_bytes(token)));
      })
      .def("is_special", &Tokenizer::is_special)
      .def("token_name", &Tokenizer::token_name)
      .def_property_readonly("vocab_size", &Tokenizer::vocab_size);

  py::class_<Utf8Stream>(m, "CppUtf8Stream")
      .def(py::init<>())
      .def("push", [](Utf8Stream& s, const py::bytes& b) { return py::bytes(s.push(std::string(b))); })
      .def("flush", [](Utf8Stream& s) { return py::bytes(s.flush()); });

  // Holds its tokenizer alive.
  struct PyStreamDecoder {
    std::shared_ptr<Tokenizer> tokenizer;
    StreamDecoder decoder;
  };
  py::class_<PyStreamDecoder>(m, "CppStreamDecoder")
      .def(py::init([](std::shared_ptr<Tokenizer> t) {
        return PyStreamDecoder{t, StreamDecoder(*t)};
      }))
      .def("push", [](PyStreamDecoder& d, int64_t token) { return py::bytes(d.decoder.push(token)); })
      .def("flush", [](PyStreamDecoder& d) { return py::bytes(d.decoder.flush()); });

  py::class_<ChatTemplate>(m, "CppChatTemplate")
      .def(py::init([](const std::string& source, std::optional<std::string> bos,
                       std::optional<std::string> eos) {
             return unwrap_run(ChatTemplate::create(source, std::move(bos), std::move(eos)));
           }),
           py::arg("source"), py::arg("bos_token") = py::none(), py::arg("eos_token") = py::none())
      .def("render",
           [](const ChatTemplate& t, const std::string& messages_json, const std::string& tools_json,
              bool add_generation_prompt, const std::string& extra_json) {
             return unwrap_run(t.render(messages_json, tools_json, add_generation_prompt, extra_json));
           },
           py::arg("messages_json"), py::arg("tools_json") = "",
           py::arg("add_generation_prompt") = true, py::arg("extra_json") = "")
      .def_property_readonly("builtin", &ChatTemplate::builtin);

  // Tool calls (tool_calls.h); executorch_cellcache/serving/tool_calls.py wraps these.
  // Tools cross as (name, parameters JSON text) pairs; offsets and lengths are bytes of
  // the UTF-8 text.
  using ToolPairs = std::vector<std::pair<std::string, std::string>>;
  auto to_tools = [](const ToolPairs& pairs) {
    std::vector<runner::Tool> tools;
    for (const auto& [name, params] : pairs) tools.push_back({name, params});
    return tools;
  };
  m.def("tools_from_request", [](const std::string& tools_json) {
    ToolPairs out;
    for (runner::Tool& t : unwrap_run(runner::tools_from_request(tools_json))) {
      out.emplace_back(std::move(t.name), std::move(t.parameters_json));
    }
    return out;
  });
  m.def("closed_objects", [](const std::string& schema_json) {
    return unwrap_run(runner::closed_objects(schema_json));
  });
  py::class_<runner::ToolCallFormat>(m, "CppToolCallFormat")
      .def_static("for_template", &runner::ToolCallFormat::for_template,
                  py::return_value_policy::reference)
      .def_static("named", [](const std::string& name) -> const runner::ToolCallFormat& {
            if (name == runner::kHermes.name) return runner::kHermes;
            if (name == runner::kLlama3Json.name) return runner::kLlama3Json;
            throw py::value_error("no tool-call format '" + name + "' (hermes, llama3_json)");
          }, py::return_value_policy::reference)
      .def_property_readonly("name", [](const runner::ToolCallFormat& f) { return std::string(f.name); })
      .def_property_readonly("trigger", [](const runner::ToolCallFormat& f) { return std::string(f.trigger); })
      .def_property_readonly("closer", [](const runner::ToolCallFormat& f) { return std::string(f.closer); })
      .def_property_readonly("at_start", [](const runner::ToolCallFormat& f) { return f.at_start; })
      .def_property_readonly("arguments_key",
                             [](const runner::ToolCallFormat& f) { return std::string(f.arguments_key); })
      .def_property_readonly("prefix", [](const runner::ToolCallFormat& f) { return std::string(f.prefix); })
      .def("call_start", [](const runner::ToolCallFormat& f, const std::string& text) {
        return f.call_start(text);
      })
      .def("undecided", [](const runner::ToolCallFormat& f, const std::string& text) {
        return f.undecided(text);
      })
      .def("parse", [](const runner::ToolCallFormat& f, const std::string& text) {
        runner::ParsedReply r = f.parse(text);
        ToolPairs calls;
        for (runner::ParsedCall& c : r.calls) calls.emplace_back(std::move(c.name), std::move(c.arguments));
        return std::make_pair(r.content, calls);
      })
      .def("grammar", [to_tools](const runner::ToolCallFormat& f, const ToolPairs& tools, bool parallel) {
        return f.grammar(to_tools(tools), parallel);
      })
      .def("lazy_grammar", [to_tools](const runner::ToolCallFormat& f, const ToolPairs& tools,
                                      bool parallel) { return f.lazy_grammar(to_tools(tools), parallel); });

  m.def("rewrite_json_schema", [](const std::string& schema) {
    return unwrap_run(runner::rewrite_schema(schema));
  });

  // A compiled grammar (opaque), shared by its matchers.
  struct PyCompiledGrammar {
    std::shared_ptr<const runner::CompiledGrammar> grammar;
  };
  py::class_<GrammarCompiler, std::shared_ptr<GrammarCompiler>>(m, "CppGrammarCompiler")
      .def(py::init([](const std::string& kind, const std::string& json, int64_t vocab_size,
                       std::vector<int64_t> stops) {
             return std::shared_ptr<GrammarCompiler>(
                 unwrap_run(GrammarCompiler::create(kind, json, vocab_size, std::move(stops))));
           }),
           py::arg("tokenizer_kind"), py::arg("tokenizer_json"), py::arg("vocab_size"),
           py::arg("stop_ids"))
      .def_property_readonly("vocab_size", &GrammarCompiler::vocab_size)
      .def("compile", [](const GrammarCompiler& c, const std::string& kind, const std::string& source) {
        return PyCompiledGrammar{unwrap_run(c.compile({kind, source}))};
      })
      .def("matcher", [](const GrammarCompiler& c, const std::string& kind, const std::string& source) {
        return std::make_unique<GrammarMatcher>(unwrap_run(c.compile({kind, source})));
      });
  py::class_<PyCompiledGrammar>(m, "CppCompiledGrammar")
      .def("matcher", [](const PyCompiledGrammar& g) { return std::make_unique<GrammarMatcher>(g.grammar); });

  py::class_<GrammarMatcher>(m, "CppGrammarMatcher")
      .def("fill",
           [](GrammarMatcher& g, py::buffer row) {
             // Written in place: a 1-D, contiguous, writable array of bytes (uint8 or
             // bool), never a converted copy.
             py::buffer_info b = row.request(/*writable=*/true);
             if (b.ndim != 1 || b.itemsize != 1 || (b.shape[0] > 1 && b.strides[0] != 1)) {
               throw py::value_error("fill takes a 1-D contiguous uint8 or bool array");
             }
             unwrap_run(g.fill(std::span<uint8_t>(static_cast<uint8_t*>(b.ptr),
                                                  static_cast<size_t>(b.shape[0]))));
           })
      .def("accept", [](GrammarMatcher& g, int64_t token) { return unwrap_run(g.accept(token)); })
      .def_property_readonly("complete", &GrammarMatcher::complete);
}

}  // namespace cellcache::bindings
