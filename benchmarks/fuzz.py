"""Fuzz the V4 chat encoder, the lenient DSML/reasoning parser and the server's request validation
with many more examples than CI runs: the properties of tests/test_fuzz.py, with random (not
derandomized) examples.

    python3 benchmarks/fuzz.py                        # 5000 examples per property
    python3 benchmarks/fuzz.py --examples 50000 --seed 7

Needs the dev extra (pytest, hypothesis). Exit status: pytest's (0 when every property held);
hypothesis prints the smallest failing example of any property that did not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages (benchmarks) importable

from benchmarks.runner import positive  # noqa: E402  (one flag parser for the benchmarks)
PROPERTIES = REPO / "tests" / "test_fuzz.py"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/fuzz.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=positive, default=5000, help="examples per property")
    parser.add_argument("--seed", type=int, help="hypothesis seed (default: random)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # tests/test_fuzz.py reads the example count from the environment (and then draws random
    # examples); CI leaves it unset.
    env = {**os.environ, "DSV4_FUZZ_EXAMPLES": str(args.examples), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PROPERTIES),
               "--hypothesis-show-statistics"]
    if args.seed is not None:
        command.append(f"--hypothesis-seed={args.seed}")
    return subprocess.run(command, cwd=REPO, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
