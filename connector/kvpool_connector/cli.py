"""`kvpool`: the user CLI (demo, bench, render, validate)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpool")
    ap.add_subparsers(dest="cmd", required=True)
    ap.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
