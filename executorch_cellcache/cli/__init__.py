"""The ``cellcache`` command line (also ``python -m executorch_cellcache``).

  cellcache export   [--model FOLDER] [--cells N] [--max-tokens-per-step K] [--out M.pte]
                     [--kv-dtype fp32|fp16|int8] [--attention cells|reference]
                     [--quantize 8da4w|8da8w] [--group-size G] [--embedding-quantize 8|4,32]
                     [--weight-scales hqq|minmax] [--window-cells auto|none|W:CELLS,...]
                     [--retained-margin R] [--pool-sequences N]
  cellcache generate M.pte --prompt TEXT [--prompt TEXT ...] [--prompts-file F|-]
                     [--max-new-tokens K] [--n N] [--temperature T] [--seed S]
                     [--chat [--system TEXT]] [--messages FILE.json] [--json]
  cellcache chat     M.pte [--system TEXT] [--max-tokens N] [--temperature T] [--top-p P]
                     [--seed S]   (an interactive chat with the program's chat template)
  cellcache eval     M.pte [--text FILE] [--window N] [--stride N]
  cellcache serve    M.pte [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-queue N]
                     [--served-model-name NAME ...]
  (generate, chat, eval, serve and bench take --threads N: the ExecuTorch thread pool's size)
  cellcache runner-path   (prints the C++ runner's path: cellcache_runner --help)
  cellcache cmake-dir     (prints the CMake package's folder: -Dexecutorch_cellcache_DIR=)
  cellcache --version     (the installed package's version)

User errors (a missing file, a bad option value, a request that can never
fit, a missing optional dependency) print one ``error:`` line and exit with
status 2, without a traceback.

One module a command, its options beside it (``add_parser(sub)`` registers
the command, ``run(args)`` runs it): ``export``, ``generate``, ``chat``,
``eval``, ``bench``, ``serve``, ``paths`` (runner-path, cmake-dir); shared
option types and groups in ``options``, prompts and conversations in
``prompts``, optional dependencies in ``extras``; ``main`` builds the parser
and dispatches.

May import every layer of the package: it is the top one.
"""

from executorch_cellcache.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
