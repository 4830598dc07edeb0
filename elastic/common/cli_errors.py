"""An argparse parser whose errors are one line (``PROG: error: MESSAGE``), exit code 2.

argparse's default prints the whole usage block before the error; for the
project's rule "bad input -> one line naming the flag" the message alone is
enough (``--help`` still prints the usage).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
