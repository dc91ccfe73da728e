"""The ``cellcache`` parser, built from the command modules, and ``main``:
runs one command and turns a user error into one ``error:`` line and exit
status 2."""

import argparse
import logging
import os
import sys
import warnings
from typing import List, Optional

from executorch_cellcache.cli import bench, chat, export, generate, paths, serve
from executorch_cellcache.cli import eval as eval_command
from executorch_cellcache.cli.extras import missing_module_message
from executorch_cellcache.cli.options import Parser

# In `cellcache --help` order; each module's add_parser registers its command(s).
COMMANDS = (export, generate, chat, eval_command, bench, serve, paths)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="cellcache",
        description="Multi-sequence cell KV cache for LLMs on ExecuTorch: export a "
                    "transformers model to a .pte, then generate for many prompts at once.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _version() -> str:
    """The installed package's version (setup.py's, from its metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("executorch-cellcache")
    except PackageNotFoundError:  # imported from a clone that pip did not install
        return "unknown (not installed)"


def _quiet_third_party_logs() -> None:
    # torchao, torch and executorch log and warn during import and export about
    # their own internals; none of it is actionable for a user of this tool.
    from executorch_cellcache.exporting.quiet_imports import NOISY_LOGGERS, NOISY_WARNING_MODULES

    for name in NOISY_LOGGERS + ("torch._export", "torch.export", "torch._dynamo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in NOISY_WARNING_MODULES:
        warnings.filterwarnings("ignore", module=module)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_third_party_logs()
    from executorch_cellcache.cache.errors import CellCacheError
    from executorch_cellcache.graph.model import UnsupportedModelError

    try:
        if getattr(args, "threads", None):  # before any program loads (runtime/threads.py)
            from executorch_cellcache.runtime.threads import set_thread_pool_size

            set_thread_pool_size(args.threads)
        return args.run(args)
    except ModuleNotFoundError as e:
        if os.environ.get("CELLCACHE_DEBUG"):
            raise
        print(f"cellcache {args.command}: error: {missing_module_message(e.name)}",
              file=sys.stderr)
        return 2
    except (CellCacheError, UnsupportedModelError, OSError, ValueError, RuntimeError) as e:
        if os.environ.get("CELLCACHE_DEBUG"):
            raise
        message = str(e).strip() or type(e).__name__
        print(f"cellcache {args.command}: error: {message}", file=sys.stderr)
        if isinstance(e, RuntimeError) and not isinstance(e, CellCacheError):
            print("(set CELLCACHE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

