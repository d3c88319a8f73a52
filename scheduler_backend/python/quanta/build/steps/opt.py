"""OPT (125M to 66B): learned positions, LayerNorm, biases, LM head tied to the embedding.

Nothing beyond the common steps: exports that drop the ``model.`` prefix are renamed by the
loader's rules, and a stored copy of the tied LM head is left out.
"""

from __future__ import annotations

from quanta.build.steps.base import FamilyBuilder


class OPTBuilder(FamilyBuilder):
    family = "opt"


BUILDERS = [OPTBuilder()]
