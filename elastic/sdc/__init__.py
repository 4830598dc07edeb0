"""Silent data corruption: the ``sdc`` config section, cross-replica agreement, replay verification,
and the bit-flip fault.

* :mod:`elastic.sdc.config`: the ``sdc:`` section (importable without torch: the launcher reads it);
* :mod:`elastic.sdc.agreement`: per-rank parameter checksums and the majority verdict over the
  replica groups of a quorum (pure, no collectives: the trainer moves the few bytes);
* :mod:`elastic.sdc.replay`: replay verification's probe in FSDP2's seams (a checked rank's gradient
  fingerprint, a capturing rank's copy of the step's weights) and a spare's replay of them;
* :mod:`elastic.sdc.results`: where its files live and how a spare answers (no torch: agents read them);
* :mod:`elastic.sdc.flip`: the chaos fault's one-bit flip in a gradient.
"""
