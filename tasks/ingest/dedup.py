"""Duplicate detection over the images kept so far: exact (content hash) and near (perceptual hash).

Near-duplicates are 64-bit perceptual hashes within a Hamming distance `d`. Comparing each new
image with every kept one is quadratic (10^10 comparisons at 100k images), so the index splits
the 64 bits into d + 1 bands: by the pigeonhole principle two hashes within distance d agree
exactly on at least one band, so only images sharing a band value are compared. With d = 4 a
band is ~13 bits wide and a lookup among 100k kept images compares ~100 candidates, not 100k.
Large distances make bands narrow and lookups slower; d above ~10 is rarely what one wants.
"""
from __future__ import annotations

from collections import defaultdict


class ExactIndex:
    """Content hash -> the first kept input that had it."""

    def __init__(self) -> None:
        self._first: dict[str, str] = {}

    def find(self, sha: str) -> str | None:
        return self._first.get(sha)

    def add(self, sha: str, name: str) -> None:
        self._first.setdefault(sha, name)


class NearIndex:
    """Perceptual hashes of kept images; `find` returns the closest within `max_distance`."""

    def __init__(self, max_distance: int, bits: int = 64) -> None:
        self.max_distance = max_distance
        n_bands = min(max_distance + 1, bits)
        edges = [round(i * bits / n_bands) for i in range(n_bands + 1)]
        self._bands = [(lo, (1 << (hi - lo)) - 1) for lo, hi in zip(edges, edges[1:])]
        self._tables: list[defaultdict[int, list[int]]] = [defaultdict(list) for _ in self._bands]
        self._hashes: list[int] = []
        self._names: list[str] = []

    def __len__(self) -> int:
        return len(self._hashes)

    def find(self, h: int) -> tuple[str, int] | None:
        """(name, distance) of the closest kept hash within the distance (earliest on ties)."""
        best: tuple[int, int] | None = None  # (distance, index)
        seen: set[int] = set()
        for (shift, mask), table in zip(self._bands, self._tables):
            for i in table.get((h >> shift) & mask, ()):
                if i in seen:
                    continue
                seen.add(i)
                d = (h ^ self._hashes[i]).bit_count()
                if d <= self.max_distance and (best is None or (d, i) < best):
                    best = (d, i)
        return None if best is None else (self._names[best[1]], best[0])

    def add(self, h: int, name: str) -> None:
        i = len(self._hashes)
        self._hashes.append(h)
        self._names.append(name)
        for (shift, mask), table in zip(self._bands, self._tables):
            table[(h >> shift) & mask].append(i)
