"""Sample agent ``textstats``: text statistics (``text.stats@1.2.0``, cost class B).

A *word* is a run of letters or digits, with inner apostrophes or hyphens
(``don't``, ``well-known``); Unicode letters count. A *sentence* is a stretch of
text ending in ``.``, ``!`` or ``?`` (or the end of the text) that contains at
least one word. ``top_words`` are the five most frequent words after case
folding, ties broken alphabetically; ``longest_word`` is the first longest word
as written.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from mesh.agent import Agent, capability

MAX_TEXT_LENGTH = 100_000
TOP_WORDS = 5

_WORD = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")
_SENTENCE_END = re.compile(r"[.!?]+")


def text_stats(text: str) -> dict[str, Any]:
    """Characters, words, sentences, average word length, top words and the longest word."""
    words = _WORD.findall(text)
    folded = Counter(word.casefold() for word in words)
    top = sorted(folded.items(), key=lambda item: (-item[1], item[0]))[:TOP_WORDS]
    sentences = sum(1 for part in _SENTENCE_END.split(text) if _WORD.search(part))
    return {
        "characters": len(text),
        "words": len(words),
        "sentences": sentences,
        "average_word_length": round(sum(map(len, words)) / len(words), 3) if words else 0.0,
        "top_words": [{"word": word, "count": count} for word, count in top],
        "longest_word": max(words, key=len, default=""),
    }


class TextStatsAgent(Agent):
    """Counts characters, words and sentences. Middling cost (B), two at a time."""

    deployment = "textstats"

    @capability(
        "text.stats",
        version="1.2.0",
        description="Characters, words, sentences, average word length, top 5 and longest word.",
        input_schema={
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": MAX_TEXT_LENGTH}},
            "required": ["text"],
            "additionalProperties": False,
        },
        output_schema={
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {
                "characters": {"type": "integer", "minimum": 0},
                "words": {"type": "integer", "minimum": 0},
                "sentences": {"type": "integer", "minimum": 0},
                "average_word_length": {"type": "number", "minimum": 0},
                "top_words": {
                    "type": "array",
                    "maxItems": TOP_WORDS,
                    "items": {
                        "type": "object",
                        "properties": {
                            "word": {"type": "string", "minLength": 1},
                            "count": {"type": "integer", "minimum": 1},
                        },
                        "required": ["word", "count"],
                        "additionalProperties": False,
                    },
                },
                "longest_word": {"type": "string"},
            },
            "required": [
                "characters",
                "words",
                "sentences",
                "average_word_length",
                "top_words",
                "longest_word",
            ],
            "additionalProperties": False,
        },
        max_concurrency=2,
        cost_class="B",
    )
    async def stats(self, payload: dict[str, Any]) -> dict[str, Any]:
        return text_stats(payload["text"])
