"""A trainer stand-in for tests/test_spare_zygote.py: its ``main`` prints what a spare that took a
slot sees of its environment (the fork's and the assignment's)."""

import json
import os


def main(argv: list[str]) -> int:
    print(json.dumps({"main": argv, "mark": os.environ.get("MARK"), "slot": os.environ.get("SLOT")}), flush=True)
    return 0
