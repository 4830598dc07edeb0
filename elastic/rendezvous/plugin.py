"""The ``torchrun.handlers`` entry point (``etcd3``).

Kept apart from :mod:`elastic.rendezvous.backend` on purpose: torch loads entry points
while its rendezvous package is being imported, so the module it loads must
not import that package at import time (it would see itself half-initialised).
"""

from __future__ import annotations


def _create(params):
    from elastic.rendezvous.backend import create_etcd3_handler

    return create_etcd3_handler(params)


def handler_factory():
    """Zero-argument factory: torchrun calls it and registers the returned creator."""
    return _create
