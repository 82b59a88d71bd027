"""The `mlp-offload` command line (probe | plan | bench | train)."""

import argparse
import json
import sys

import mlp_offload


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mlp-offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print build information as JSON")
    args = parser.parse_args(argv)
    if args.command == "info":
        json.dump(mlp_offload.build_info(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
