"""The options several ``kvmove-bench`` subcommands share, and the check of ``--plot`` that
runs before anything is measured."""

from __future__ import annotations

import argparse
import os

from kvmove.agent import ERROR_MODES, SAME_HOST_PATHS
from kvmove.errors import ConfigError
from kvmove.kv_spec import PRESETS

__all__ = ["add_agent_args", "add_output_args", "add_prompt_args", "check_plot"]


def add_prompt_args(sub: argparse.ArgumentParser, model_paths: bool = False) -> None:
    """The model and prompt the subcommands describe: --model, --tokens, --block-size.

    ``model_paths``: --model may also be a Hugging Face ``config.json`` or a directory holding
    one (checked where it is read, ``kvmove.bench.model_shapes``).
    """
    presets = f"model preset, one of: {', '.join(PRESETS)}"
    if model_paths:
        sub.add_argument("--model", default="llama-3.1-8b", metavar="NAME|PATH",
                         help=f"{presets}; or a Hugging Face config.json, or a directory "
                         "holding one (default %(default)s)")
    else:
        sub.add_argument("--model", choices=list(PRESETS), default="llama-3.1-8b",
                         metavar="NAME", help=f"{presets} (default %(default)s)")
    sub.add_argument("--tokens", type=int, default=4000, help="prompt length (default 4000)")
    sub.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")


def add_agent_args(sub: argparse.ArgumentParser, who: str) -> None:
    """--transports and --error-mode, as kvmove.Agent takes them."""
    sub.add_argument("--transports", default=None, metavar="UCX_TLS",
                     help=f"UCX transport list for {who}, e.g. tcp, 'posix,cma' (default: "
                     "UCX's choice)")
    sub.add_argument("--error-mode", choices=list(ERROR_MODES), default="peer",
                     help="'peer' detects dead peers, on one host over shared memory and cma "
                     "too; 'none' (expert) does not (default peer, as kvmove.Agent)")
    sub.add_argument("--same-host", choices=list(SAME_HOST_PATHS), default="map",
                     help="'map': same-host peers copy into each other's mapped memory; 'ucx': "
                     "UCX's transports only (default map, as kvmove.Agent)")


def add_output_args(sub: argparse.ArgumentParser, iters_help: str, plot_help: str) -> None:
    """--iters, --timeout, --json and --plot."""
    sub.add_argument("--iters", type=int, default=3, help=f"{iters_help} (default 3)")
    sub.add_argument("--timeout", type=float, default=60.0,
                     help="deadline of every wait in seconds (default 60)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.add_argument("--plot", metavar="PNG", default=None, help=plot_help)


def check_plot(path: str) -> None:
    """Before measuring: ``path``'s folder there, and matplotlib importable."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path!r}: no folder {folder!r} to write it in")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install kvmove[bench]") from None
