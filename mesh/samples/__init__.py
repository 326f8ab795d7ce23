"""Sample agents that do real, offline work, one per cost class.

=========  =====================  ====  ===============
key        capability             cost  max_concurrency
=========  =====================  ====  ===============
calc       ``math.evaluate@1.0.0``  A     4
textstats  ``text.stats@1.2.0``     B     2
echo       ``test.echo@1.0.0``      C     8
=========  =====================  ====  ===============

``mesh agent <key>`` runs one of them; ``SAMPLES`` maps the keys to the classes.
"""

from mesh.agent import Agent
from mesh.samples.calc import CalcAgent, CalcError, evaluate
from mesh.samples.echo import EchoAgent
from mesh.samples.textstats import TextStatsAgent, text_stats

SAMPLES: dict[str, type[Agent]] = {
    "calc": CalcAgent,
    "textstats": TextStatsAgent,
    "echo": EchoAgent,
}

__all__ = [
    "SAMPLES",
    "CalcAgent",
    "CalcError",
    "EchoAgent",
    "TextStatsAgent",
    "evaluate",
    "text_stats",
]
