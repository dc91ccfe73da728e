"""Serving: ``cellcache serve``, an OpenAI-compatible HTTP server over one
cell-cache program with continuous batching.

- ``protocol``: pydantic models of the OpenAI request, response, chunk and
  error schemas (what the wire carries, nothing else);
- ``engine``: one thread owns the Runner and steps the Scheduler; requests are
  submitted and cancelled from the HTTP side, thread-safe;
- ``text``: token ids -> text pieces, stop strings, logprob entries;
- ``chat_template``: jinja2 chat templates rendered as transformers does;
- ``strict_schema``: ``"strict": true`` JSON schemas made strict as OpenAI
  defines it (no keys but the named ones, every property required);
- ``tool_calls``: tool-call formats (Hermes / Qwen, Llama 3 JSON): the grammar
  that forces a call, the parser that reads calls out of a reply;
- ``completions``: OpenAI requests -> engine submissions, engine outputs ->
  OpenAI responses and stream chunks;
- ``metrics``: the Prometheus metrics of ``/metrics``;
- ``app``: FastAPI routes, lifespan, auth and errors (never touches the cache);
- ``static/``: the chat page ``GET /`` serves (plain HTML, JS and CSS: no build
  step, nothing fetched from elsewhere).

May import ``cache`` and ``runtime`` only.
"""
