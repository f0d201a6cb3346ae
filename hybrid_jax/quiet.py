"""Keep library chatter out of the tools' output: Orbax logs through absl, which prints ``WARNING:absl:...`` lines
(e.g. "Given directory is read only") on every read of a checkpoint. The command-line tools call
:func:`quiet_absl` first; ``HYBRID_JAX_VERBOSE=1`` keeps those lines.
"""

from __future__ import annotations

import logging
import os


def quiet_absl() -> None:
    """Show only absl errors (Orbax's warnings are about its own defaults, not about the user's run)."""
    if os.environ.get("HYBRID_JAX_VERBOSE", "") in ("", "0"):
        logging.getLogger("absl").setLevel(logging.ERROR)
