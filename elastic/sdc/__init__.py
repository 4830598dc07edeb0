"""Silent data corruption: the ``sdc`` config section, cross-replica agreement, and the bit-flip fault.

* :mod:`elastic.sdc.config`: the ``sdc:`` section (importable without torch: the launcher reads it);
* :mod:`elastic.sdc.agreement`: per-rank parameter checksums and the majority verdict over the
  replica groups of a quorum (pure, no collectives: the trainer moves the few bytes);
* :mod:`elastic.sdc.flip`: the chaos fault's one-bit flip in a gradient shard.
"""
