"""The caption policy: what an image's caption becomes, or why the image is dropped.

Captions come from a sidecar file, a metadata row, a metadata JSON's tags, a hub column or the
source's instance prompt. Missing or blank ones follow `captions.empty`; ones longer than
`captions.max_words` follow `captions.too_long`. Truncating a tag caption drops whole tags from
the end (the stored `tags` list is truncated the same way), never half a tag.
"""
from __future__ import annotations

from dataclasses import dataclass

from tasks.ingest.checks import Reject
from tasks.ingest.config import Captions


@dataclass(frozen=True)
class Caption:
    text: str
    tags: list[str]
    source: str  # file | instance_prompt | folder_name (kohya's) | metadata | tags | hub | fallback | captioner
    truncated: bool = False


def decide(
    text: str | None, source: str, tags: list[str] | None, separator: str | None, policy: Captions
) -> Caption:
    """Apply the policy to one image's caption (`tags` and `separator` for tag captions)."""
    tags = list(tags or [])
    if text is None or not text.strip():
        if policy.empty == "drop":
            raise Reject("empty_caption", "no caption (captions.empty: drop)")
        return Caption(policy.fallback, [], "fallback")
    words = text.split()
    limit = policy.max_words
    if limit is None or len(words) <= limit:
        return Caption(text, tags, source)
    if policy.too_long == "drop":
        raise Reject("long_caption", f"{len(words)} words > captions.max_words {limit}")
    if policy.too_long == "fallback":
        return Caption(policy.fallback, [], "fallback")
    if tags and separator is not None:
        kept: list[str] = []
        for tag in tags:
            if len(separator.join([*kept, tag]).split()) > limit:
                break
            kept.append(tag)
        if kept:
            return Caption(separator.join(kept), kept, source, truncated=True)
        first = " ".join(tags[0].split()[:limit])
        return Caption(first, [first], source, truncated=True)
    return Caption(" ".join(words[:limit]), tags, source, truncated=True)
