"""Command line: ``python -m tpu_helpers {doctor,fixtures,plan,install}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_helpers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check that TF, tf-keras, transformers and datasets fit together")
    sub.add_parser("plan", help="print the install commands this runtime needs (runs nothing)")
    inst = sub.add_parser(
        "install",
        help="what the notebooks' install cell does: run the plan on Colab or Kaggle, print it"
        " elsewhere",
    )
    inst.add_argument(
        "--engine",
        default="tf",
        help="tf (the notebooks of notebooks/tf/) or keras3 (the main track, notebooks/)",
    )
    fx = sub.add_parser("fixtures", help="build the offline checkpoints and data sets")
    fx.add_argument("directory", help="where to write them, e.g. build/fixtures")
    fx.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.command == "plan":
        from tpu_helpers.runtime import detect_runtime, install_commands

        for command in install_commands(detect_runtime()):
            print(command)
        return 0
    if args.command == "install":
        from tpu_helpers.runtime import install

        install(engine=args.engine)
        return 0
    if args.command == "doctor":
        from tpu_helpers.runtime.doctor import doctor

        return 0 if all(c.ok for c in doctor()) else 1
    from tpu_helpers.teaching.fixtures import build_fixtures

    build_fixtures(args.directory, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
