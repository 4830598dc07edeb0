"""Run torchft's Lighthouse without importing torch: ``python elastic/replicas/lighthouse_main.py --bind ...``.

The Lighthouse is a Rust server inside the ``torchft._torchft`` extension module.
Going through the ``torchft_lighthouse`` console script imports the ``torchft``
package, and with it torch: 1-4 s on a loaded host, during which the leader agent
that starts it cannot refresh its leader lease.  This loads the extension module
straight from the installed package directory instead.

Run it by path, not with ``-m`` or ``-c``: the Lighthouse parses the process's own
argv from argv[1] on, so argv[1] must be this file.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def load_extension():
    spec = importlib.util.find_spec("torchft")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("lighthouse: torchft is not installed")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / f"_torchft{suffix}"
        if path.exists():
            loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(path))
            module_spec = importlib.util.spec_from_loader("torchft._torchft", loader)
            module = importlib.util.module_from_spec(module_spec)
            loader.exec_module(module)
            return module
    raise SystemExit(f"lighthouse: no _torchft extension module in {package_dir}")


if __name__ == "__main__":
    sys.exit(load_extension().lighthouse_main())
