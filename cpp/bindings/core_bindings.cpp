// executorch_cellcache.cache._core: the Python face of the C++ cell cache.
//
// Every failed Status becomes the exception class of
// executorch_cellcache.cache.errors named after its code; nothing else validates
// here except converting Python ints to the core's int32 ids and positions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "binding_util.h"
#include "cellcache/admission.h"
#include "cellcache/cell_cache.h"
#include "cellcache/step_batch.h"
#include "graph/registry.h"

namespace py = pybind11;
using namespace cellcache;
using namespace cellcache::bindings;

namespace {

// A placed layer handed to Python: copies, so it outlives the next verb.
struct PlacedStep {
  py::array_t<int32_t> cells;  // [n_tok]
  py::array_t<bool> mask;      // [n_tok, used_end]
};

// A pool's state handed to Python: copies, as PlacedStep.
struct PyPoolState {
  std::optional<int32_t> window;
  bool reclaims = false;
  std::vector<int32_t> layers;
  int32_t capacity = 0, free_cells = 0, used_end = 0, written_end = 0, planned_used_end = 0;
  py::array_t<int32_t> cell_positions;  // [capacity]
  py::array_t<int32_t> step_cells;      // [n_tok]
};

template <typename T>
py::array_t<std::remove_const_t<T>> copy_array(std::span<T> span) {
  return py::array_t<std::remove_const_t<T>>(static_cast<py::ssize_t>(span.size()), span.data());
}

PlacedStep to_python(const LayerStep& s) {
  PlacedStep out{py::array_t<int32_t>(s.n_tok),
                 py::array_t<bool>({static_cast<py::ssize_t>(s.n_tok),
                                    static_cast<py::ssize_t>(s.used_end)})};
  std::copy(s.cells.begin(), s.cells.end(), out.cells.mutable_data());
  std::transform(s.mask.begin(), s.mask.end(), out.mask.mutable_data(),
                 [](uint8_t v) { return v != 0; });
  return out;
}

// Owns a core cache and its registry handle (the graph ops find it by handle).
class PyCellCache {
 public:
  PyCellCache(Int n_cells, std::optional<Int> n_layers, std::vector<std::optional<Int>> windows,
              std::optional<std::map<Int, Int>> window_cells,
              std::optional<Int> retained_margin) {
    CacheConfig config;
    config.n_cells = config_int("n_cells", n_cells);
    config.n_layers = config_int("n_layers",
                                 n_layers.value_or(Int{static_cast<int64_t>(windows.size())}));
    for (const auto& w : windows) {
      config.windows.push_back(w.has_value() ? Window(config_int("window", *w)) : std::nullopt);
    }
    for (const auto& [w, cells] : window_cells.value_or(std::map<Int, Int>{})) {
      config.window_pools.push_back(
          {config_int("window_cells window", w), config_int("window_cells cells", cells)});
    }
    // {} asks for pools, as None does not: with a sliding layer it sizes too few.
    if (window_cells.has_value() && window_cells->empty()) {
      for (const Window& w : config.windows) {
        if (!w.has_value()) continue;
        raise(Status(StatusCode::kInvalidConfig,
                     "window_cells must size the pool of every sliding window of the layers; "
                     "window " + std::to_string(*w) + " has none, got {}"));
      }
    }
    if (retained_margin.has_value()) {
      config.retained_margin = config_int("retained_margin", *retained_margin);
    }
    cache_ = unwrap(CellCache::create(config));
    handle_ = register_cache(cache_.get());
  }
  ~PyCellCache() { unregister_cache(handle_); }
  PyCellCache(const PyCellCache&) = delete;
  PyCellCache& operator=(const PyCellCache&) = delete;

  CellCache& core() { return *cache_; }
  const CellCache& core() const { return *cache_; }
  int64_t handle() const { return handle_; }

 private:
  std::unique_ptr<CellCache> cache_;
  int64_t handle_ = 0;
};

// Ids beyond int32 can name no sequence; refuse them here so the message shows
// the value the caller passed rather than a saturated one.
seq_t seq_id(int64_t id) {
  if (id < std::numeric_limits<int32_t>::min() || id > std::numeric_limits<int32_t>::max()) {
    raise(Status(StatusCode::kUnknownSequence,
                 "unknown sequence id " + std::to_string(id) + " (ids lie in [0, " +
                     std::to_string(kMaxSequences) + "))"));
  }
  return static_cast<seq_t>(id);
}

int32_t layer_index(const CellCache& cache, int64_t layer) {
  if (layer < std::numeric_limits<int32_t>::min() || layer > std::numeric_limits<int32_t>::max()) {
    raise(Status(StatusCode::kLayerOutOfRange,
                 "layer " + std::to_string(layer) + " is out of range [0, " +
                     std::to_string(cache.n_layers()) + ")"));
  }
  return static_cast<int32_t>(layer);
}

// A pool index beyond int32 names no pool; refuse it with the value passed.
int32_t pool_index(int64_t pool) {
  if (pool < std::numeric_limits<int32_t>::min() || pool > std::numeric_limits<int32_t>::max()) {
    raise(Status(StatusCode::kInvalidConfig,
                 "pool " + std::to_string(pool) + " is out of range, got " + std::to_string(pool)));
  }
  return static_cast<int32_t>(pool);
}

std::vector<seq_t> to_seq_ids(const std::vector<Int>& ids) {
  std::vector<seq_t> out;
  out.reserve(ids.size());
  for (Int id : ids) out.push_back(seq_id(id));
  return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "C++ cell cache core (see cpp/cellcache/cell_cache.h)";
  m.attr("MAX_SEQUENCES") = kMaxSequences;
  m.attr("MAX_CELLS") = kMaxCells;
  m.attr("DEFAULT_RETAINED_MARGIN") = kDefaultRetainedMargin;

  py::class_<PlacedStep>(m, "PlacedStep",
                         "One served layer of a step (a copy; outlives later verbs).")
      .def_readonly("cells", &PlacedStep::cells, "int32 [n_tok]: the cell of each token")
      .def_readonly("mask", &PlacedStep::mask,
                    "bool [n_tok, used_end]: mask[i, c] = token i may attend cell c");

  py::class_<PyPoolState>(m, "PoolState",
                          "One pool of a CellCache (a copy; CellCache.pool(i)).")
      .def_readonly("window", &PyPoolState::window, "None = full causal, else W")
      .def_readonly("reclaims", &PyPoolState::reclaims, "a windowed pool of a pooled cache")
      .def_readonly("layers", &PyPoolState::layers, "the layers reading this pool")
      .def_readonly("capacity", &PyPoolState::capacity, "cells (a layer's K/V buffer rows)")
      .def_readonly("free_cells", &PyPoolState::free_cells)
      .def_readonly("used_end", &PyPoolState::used_end)
      .def_readonly("written_end", &PyPoolState::written_end)
      .def_readonly("planned_used_end", &PyPoolState::planned_used_end)
      .def_readonly("cell_positions", &PyPoolState::cell_positions,
                    "int32 [capacity]: position per cell, -1 = empty")
      .def_readonly("step_cells", &PyPoolState::step_cells,
                    "int32 [n_tok]: the declared step's cells in this pool");

  py::class_<PyCellCache>(m, "CellCache", R"doc(
A pool of n_cells KV-cache cells shared by up to 256 sequences (SPEC section 1).

CellCache(n_cells, n_layers=None, windows=[None]): windows has 1 entry (every
layer) or n_layers entries; None = full causal attention, int W = sliding
window of W positions (a token at position p sees p-W+1 .. p). n_layers
defaults to len(windows). Raises InvalidConfigError (a ValueError).

window_cells (keyword): None = one pool of n_cells cells for every layer
(nothing reclaimed). A dict {W: cells} for every sliding window W of the
layers = one pool per window policy: n_cells for the full-attention layers
(unused without any), `cells` for the layers of window W; a windowed pool
reclaims the cells no owner can see again, keeping retained_margin (keyword,
default 32) positions below each sequence's window for rollback. Each needs
>= W + retained_margin + 1 cells. A rollback or prefix clone needing a
reclaimed position raises BelowReclaimedError.

Sequence verbs: seq_new, seq_clone, seq_rm, seq_free, clear. Step protocol:
declare_step(seq_ids) before each forward (the admission gate), then
place_step(positions, layer) once per layer. Every failed call raises a
CellCacheError subclass and changes nothing.)doc")
      .def(py::init<Int, std::optional<Int>, std::vector<std::optional<Int>>,
                    std::optional<std::map<Int, Int>>, std::optional<Int>>(),
           py::arg("n_cells"), py::arg("n_layers") = py::none(),
           py::arg("windows") = std::vector<std::optional<Int>>{std::nullopt},
           py::kw_only(), py::arg("window_cells") = py::none(),
           py::arg("retained_margin") = py::none())
      .def("seq_new", [](PyCellCache& c) { return unwrap(c.core().seq_new()); },
           "A new, empty sequence id (the lowest free). CapacityError when 256 are live.")
      .def("seq_clone",
           [](PyCellCache& c, Int src, std::optional<Int> upto) {
             return unwrap(c.core().seq_clone(seq_id(src), to_i32(upto)));
           },
           py::arg("src"), py::arg("upto") = py::none(),
           "A new sequence sharing src's cells with position < upto (all when None): one\n"
           "more owner per cell, no K/V copied, no cell allocated. UnknownSequenceError,\n"
           "PositionConflictError (upto < 0), CapacityError (no free id).")
      .def("seq_rm",
           [](PyCellCache& c, Int seq, Int p0, std::optional<Int> p1) {
             check(c.core().seq_rm(seq_id(seq), to_i32(p0), to_i32(p1)));
           },
           py::arg("seq"), py::arg("p0") = 0, py::arg("p1") = py::none(),
           "seq stops owning positions in [p0, p1) (p1 None = to the end); cells left\n"
           "without owner free. UnknownSequenceError, PositionConflictError (p0 < 0, p1 < p0).")
      .def("seq_free", [](PyCellCache& c, Int seq) { check(c.core().seq_free(seq_id(seq))); },
           py::arg("seq"), "Removes every position of seq and releases its id.")
      .def("clear", [](PyCellCache& c) { c.core().clear(); },
           "Empties every cell and releases every id.")
      .def("next_pos", [](const PyCellCache& c, Int seq) {
             return unwrap(c.core().next_pos(seq_id(seq)));
           }, py::arg("seq"), "One past the highest position seq holds (0 when empty).")
      .def("seq_len", [](const PyCellCache& c, Int seq) {
             return unwrap(c.core().seq_len(seq_id(seq)));
           }, py::arg("seq"), "How many positions seq holds.")
      .def("cells_owned_only_by",
           [](const PyCellCache& c, const std::vector<Int>& seq_ids, Int pool) {
             return unwrap(c.core().cells_owned_only_by(to_seq_ids(seq_ids), pool_index(pool)));
           },
           py::arg("seq_ids"), py::arg("pool") = 0,
           "Occupied cells of pool (0: layer 0's) whose every owner is in seq_ids: the cells\n"
           "that freeing all of them would free there (a prefix cache's own cells).\n"
           "UnknownSequenceError, InvalidConfigError (pool).")
      .def("seq_serial", [](const PyCellCache& c, Int seq) {
             return unwrap(c.core().seq_serial(seq_id(seq)));
           }, py::arg("seq"),
           "A number naming this lifetime of the id: every seq_new/seq_clone hands out a\n"
           "larger one, never reused (not even after clear), so a holder of (id, serial)\n"
           "can tell that the id was freed and handed out again. UnknownSequenceError.")
      .def("can_extend", [](const PyCellCache& c, Int n) {
             return n >= 0 && n <= std::numeric_limits<int32_t>::max() &&
                    c.core().can_extend(static_cast<int32_t>(n));
           }, py::arg("n_tok"), "Whether a step of n_tok more tokens fits in every pool's free cells.")
      .def("holds_prefix",
           [](const PyCellCache& c, Int seq, Int upto) {
             return unwrap(c.core().holds_prefix(seq_id(seq), to_i32(upto)));
           },
           py::arg("seq"), py::arg("upto"),
           "Whether every pool still holds what seq's positions below upto need: whether\n"
           "seq_clone(seq, upto) and seq_rm(seq, upto) pass the reclaim check.\n"
           "UnknownSequenceError, PositionConflictError (upto < 0).")
      .def("pool_of", [](const PyCellCache& c, Int layer) {
             return unwrap(c.core().pool_of(layer_index(c.core(), layer)));
           }, py::arg("layer"), "The pool whose cells the layer reads and writes.")
      .def("pool",
           [](const PyCellCache& c, Int pool) {
             const int32_t index = pool_index(pool);
             PoolState st = unwrap(c.core().pool_state(index));
             PyPoolState out;
             out.window = st.window;
             out.reclaims = st.reclaims;
             for (int32_t l = 0; l < c.core().n_layers(); ++l) {
               if (c.core().pool_of(l).value() == index) out.layers.push_back(l);
             }
             out.capacity = st.capacity;
             out.free_cells = st.free_cells;
             out.used_end = st.used_end;
             out.written_end = st.written_end;
             out.planned_used_end = st.planned_used_end;
             out.cell_positions = copy_array(st.cell_positions);
             out.step_cells = copy_array(st.step_cells);
             return out;
           },
           py::arg("pool"),
           "A PoolState (copies) of one pool, 0 <= pool < n_pools. InvalidConfigError.")
      .def("reclaimed",
           [](const PyCellCache& c, Int seq, Int pool) {
             Reclaimed r = unwrap(c.core().reclaimed(seq_id(seq), pool_index(pool)));
             return py::make_tuple(r.below, r.count);
           },
           py::arg("seq"), py::arg("pool"),
           "(below, count): pool gave up seq's positions < below, count of them ((0, 0)\n"
           "when none). UnknownSequenceError, InvalidConfigError (pool).")
      .def("window", [](const PyCellCache& c, Int layer) {
             return unwrap(c.core().window(layer_index(c.core(), layer)));
           }, py::arg("layer"), "The layer's window (None = full causal).")
      .def("declare_step",
           [](PyCellCache& c, const std::vector<Int>& seq_ids) {
             return unwrap(c.core().declare_step(to_seq_ids(seq_ids)));
           },
           py::arg("seq_ids"),
           "Declares the next forward: one sequence id per token, in graph order. True =\n"
           "admitted (replaces a declared step that has not run); False = the tokens do not\n"
           "fit in the free cells, nothing changed. UnknownSequenceError.")
      .def("place_step",
           [](PyCellCache& c, const py::object& positions, Int layer) {
             Int64Array pos = int64_array(positions, "positions");
             return to_python(
                 unwrap(c.core().place_step(as_span(pos), layer_index(c.core(), layer))));
           },
           py::arg("positions"), py::arg("layer"),
           "Serves one layer of the declared step. positions: int [n_tok], each token's\n"
           "position in its sequence. The first layer served places the tokens; later\n"
           "layers reuse the placement; each layer is served once per step. Returns a\n"
           "PlacedStep. LayerOutOfRangeError, StepNotDeclaredError, StepInvalidatedError,\n"
           "PositionConflictError (count differs from the declaration, or a position that\n"
           "rewrites, repeats or goes backwards).")
      .def("attend_plan",
           [](PyCellCache& c, Int layer) {
             AttendPlan plan = unwrap(c.core().attend_plan(layer_index(c.core(), layer)));
             auto arr = [](auto span) { return copy_array(span); };
             py::dict d;
             d["cells"] = arr(plan.cells);
             d["group_begin"] = arr(plan.group_begin);
             d["tok_group"] = arr(plan.tok_group);
             d["tok_begin"] = arr(plan.tok_begin);
             d["tok_end"] = arr(plan.tok_end);
             d["group_reclaimed"] = arr(plan.group_reclaimed);
             return d;
           },
           py::arg("layer"),
           "The attention plan of a layer served in the current step (copies): cells (each\n"
           "step sequence's cells by position, grouped), group_begin, and per token its group\n"
           "and [tok_begin, tok_end) range in cells, and group_reclaimed (per group, the positions its\n"
           "pool reclaimed before its first listed cell). StepNotDeclaredError when the layer was\n"
           "not placed in this step, StepInvalidatedError, LayerOutOfRangeError.")
      .def("check_invariants", [](const PyCellCache& c) { check(c.core().check_invariants()); },
           "Recomputes the derived state from the cells; raises if it disagrees (tests).")
      .def("cell_positions", [](const PyCellCache& c) {
             auto p = c.core().cell_positions();
             return py::array_t<int32_t>(static_cast<py::ssize_t>(p.size()), p.data());
           }, "int32 [n_cells]: the position each cell holds, -1 = empty.")
      .def_property_readonly("capacity", [](const PyCellCache& c) { return c.core().capacity(); },
                             "n_cells (of pool 0, the pool of layer 0; see pool())")
      .def_property_readonly("free_cells",
                             [](const PyCellCache& c) { return c.core().free_cells(); },
                             "Cells owned by no sequence.")
      .def_property_readonly("used_end", [](const PyCellCache& c) { return c.core().used_end(); },
                             "One past the highest occupied cell index.")
      .def_property_readonly("n_layers", [](const PyCellCache& c) { return c.core().n_layers(); })
      .def_property_readonly("n_pools", [](const PyCellCache& c) { return c.core().n_pools(); },
                             "1, or one per distinct window when window_cells is given.")
      .def_property_readonly("retained_margin",
                             [](const PyCellCache& c) { return c.core().retained_margin(); },
                             "R: positions a windowed pool keeps below each sequence's window.")
      .def_property_readonly("n_sequences",
                             [](const PyCellCache& c) { return c.core().n_sequences(); },
                             "Live sequence ids (handed out and not freed).")
      .def_property_readonly("written_end",
                             [](const PyCellCache& c) { return c.core().written_end(); },
                             "One past the highest cell any step placed into (never shrinks).")
      .def_property_readonly("planned_used_end",
                             [](const PyCellCache& c) { return c.core().planned_used_end(); },
                             "used_end once the declared step places: the attention extent\n"
                             "to pass to the forward.")
      .def_property_readonly("handle", &PyCellCache::handle,
                             "int64 naming this cache to the graph ops (a forward's handle input).");

  // Admission arithmetic (cellcache/admission.h) and the step-batch checks
  // (cellcache/step_batch.h): one home for the rules the schedulers and the
  // runners apply.
  m.def("request_worst_case_cells",
        [](Int prompt_len, Int cached, Int n, Int max_new_tokens) {
          return request_worst_case_cells(prompt_len, cached, n, max_new_tokens);
        },
        py::arg("prompt_len"), py::arg("cached"), py::arg("n"), py::arg("max_new_tokens"),
        "The most cells a request not yet started can still claim: prompt_len - cached +\n"
        "n * (max_new_tokens - 1) (the prompt placed once, n samples sharing it, each\n"
        "feeding back all its tokens but the last; cached = prompt tokens cloned from a\n"
        "cached prefix).");
  m.def("check_request_fits",
        [](const std::string& label, Int prompt_len, Int n, Int max_new_tokens, Int capacity) {
          check(check_request_fits(label, prompt_len, n, max_new_tokens, capacity));
        },
        py::arg("label"), py::arg("prompt_len"), py::arg("n"), py::arg("max_new_tokens"),
        py::arg("capacity"),
        "Raises CapacityError when a request could not run even in an empty cache of\n"
        "`capacity` cells (too many cells, or n beyond MAX_SEQUENCES); label names the\n"
        "request in the message (\"prompt 3\").");
  m.def("request_worst_case_cells_in_pool",
        [](Int prompt_len, Int cached, Int n, Int max_new_tokens, std::optional<Int32> window,
           Int retained_margin, Int step_tokens) {
          return request_worst_case_cells_in_pool(prompt_len, cached, n, max_new_tokens,
                                                  Window(window), retained_margin, step_tokens);
        },
        py::arg("prompt_len"), py::arg("cached"), py::arg("n"), py::arg("max_new_tokens"),
        py::arg("window"), py::arg("retained_margin"), py::arg("step_tokens"),
        "request_worst_case_cells in a pool of `window` (None = full): a windowed pool's\n"
        "is at most n * (window + max(retained_margin, step_tokens - 1) + step_tokens).");
  m.def("check_request_fits_pools",
        [](const std::string& label, Int prompt_len, Int n, Int max_new_tokens,
           const std::vector<std::pair<std::optional<Int>, Int>>& pools, Int retained_margin,
           Int step_tokens) {
          std::vector<PoolLimit> limits;
          for (const auto& [w, capacity] : pools) {
            limits.push_back({w ? Window(config_int("window", *w)) : std::nullopt, capacity});
          }
          check(check_request_fits_pools(label, prompt_len, n, max_new_tokens, limits,
                                         retained_margin, step_tokens));
        },
        py::arg("label"), py::arg("prompt_len"), py::arg("n"), py::arg("max_new_tokens"),
        py::arg("pools"), py::arg("retained_margin"), py::arg("step_tokens"),
        "check_request_fits for every pool: pools is [(window or None, capacity)].\n"
        "CapacityError naming the first pool that is too small (or n beyond\n"
        "MAX_SEQUENCES); InvalidConfigError for retained_margin < 0 or step_tokens < 1.");
  m.def("check_step_batch",
        [](Int n_seq_ids, const py::object& tokens, Int n_positions, const py::object& logits_for,
           Int max_tokens_per_step, Int vocab_size) {
          Int64Array t = int64_array(tokens, "tokens");
          Int64Array l = int64_array(logits_for, "logits_for");
          check(check_step_batch(static_cast<size_t>(std::max<int64_t>(n_seq_ids, 0)),
                                 as_span(t), static_cast<size_t>(std::max<int64_t>(n_positions, 0)),
                                 as_span(l), max_tokens_per_step, vocab_size));
        },
        py::arg("n_seq_ids"), py::arg("tokens"), py::arg("n_positions"), py::arg("logits_for"),
        py::arg("max_tokens_per_step"), py::arg("vocab_size"),
        "Raises InvalidConfigError when a forward's inputs break the step rules, checked\n"
        "in this order: seq_ids (n_seq_ids long), tokens and positions (n_positions long)\n"
        "differ in length; the step carries fewer than 1 or more than max_tokens_per_step\n"
        "tokens; logits_for holds fewer than 1 or more than len(tokens) indices, or one\n"
        "outside [0, len(tokens)); a token id lies outside [0, vocab_size).");

  bind_graph_ops(m);
  bind_engine(m, [](py::handle cache) -> CellCache& { return cache.cast<PyCellCache&>().core(); });
  bind_text(m);
}
