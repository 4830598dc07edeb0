"""Bring your own loop: a plain FSDP2 model trained through :mod:`elastic.api` (see ``train``)."""
