"""OPT (125M to 66B): learned positions, LayerNorm, biases, LM head tied to the embedding.

Nothing beyond the common steps: exports that drop the ``model.`` prefix are renamed by the
loader's rules, and a stored copy of the tied LM head is left out. OPT's spec
(``quanta.families.opt``) names this class as the family's builder.
"""

from __future__ import annotations

from build_scripts.base import FamilyBuilder


class OPTBuilder(FamilyBuilder):
    family = "opt"
