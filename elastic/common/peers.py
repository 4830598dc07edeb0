"""What a lost peer looks like from inside a collective (gloo and NCCL error texts)."""

from __future__ import annotations

PEER_LOST_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                     "connectFullMesh failed", "Connection refused", "Socket closed")


def is_peer_lost(text: str) -> bool:
    """True when an error text says a collective failed because another rank went away."""
    return any(marker in text for marker in PEER_LOST_MARKERS)
