"""Write gpuwatchd's bash and zsh completion scripts, generated from the real argparse parser.

    python3 packaging/completions.py BASH_FILE ZSH_FILE

Run at package build time (packaging/debian/rules), so the completions always match the
commands and flags of the version they ship with. The generating is done by shtab (Debian 12:
python3-shtab; pip: shtab), a small, maintained library that walks an argparse parser: a
generator of our own would be a second description of the command line to keep in step.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: completions.py BASH_FILE ZSH_FILE", file=sys.stderr)
        return 2
    import shtab

    from gpuwatchd.cli.main import build_parser

    for shell, target in zip(("bash", "zsh"), argv):
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(shtab.complete(build_parser(), shell=shell))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
