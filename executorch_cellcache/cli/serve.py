"""``cellcache serve``: an OpenAI-compatible HTTP server over one program
(serving/), run by uvicorn."""

import copy
import os
from pathlib import Path

from executorch_cellcache.cli.options import (add_prefix_cache_options, add_speculative_options,
                                              add_threads_option, positive_int, speculative)


def add_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with continuous batching",
        description="Serve a cell-cache .pte over OpenAI's HTTP API (/v1/models, "
                    "/v1/completions, /v1/chat/completions with streaming, /health, "
                    "/metrics). Every concurrent request shares the program's forwards: a "
                    "request that arrives while others decode joins the next step.")
    serve.add_argument("model", metavar="MODEL.pte", help="a .pte written by `cellcache export` "
                                                          "(it must carry a tokenizer)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 "
                            "exposes the server to the network)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    serve.add_argument("--api-key", metavar="KEY", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                            "$CELLCACHE_API_KEY, else no key)")
    serve.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                       help="requests that may wait for cache room; more get HTTP 429 "
                            "(default 64)")
    serve.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                       help="a name a request may give as its \"model\" (repeat for several): "
                            "/v1/models lists them, responses report the first (default: the "
                            "program file's name without .pte)")
    add_prefix_cache_options(serve)
    add_speculative_options(serve)
    add_threads_option(serve)
    serve.set_defaults(run=run)


def run(args) -> int:
    import uvicorn

    from executorch_cellcache.serving.app import create_app

    path = Path(args.model)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist" if not path.exists() else
                                f"{path} is not a file")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("CELLCACHE_API_KEY")
    server = None

    def stop():
        server.should_exit = True

    spec = speculative(args)
    app = create_app(path, api_key=api_key or None, max_queue=args.max_queue,
                     on_load_failure=stop,
                     runner_options=dict(prefix_cache=args.prefix_cache,
                                         prefix_cache_cells=args.prefix_cache_cells),
                     speculative=spec, served_model_names=args.served_model_name or None)
    # The server's log goes to stdout: the runner redirects file descriptor 2 during each
    # forward (it quotes the runtime's lines in errors), which would swallow log lines.
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["default"]["stream"] = "ext://sys.stdout"
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="info", log_config=log_config,
                                           timeout_graceful_shutdown=5))
    server.run()
    if app.state.load_error:
        raise ValueError(app.state.load_error)
    return 0
