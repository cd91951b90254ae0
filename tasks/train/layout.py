"""Which image each example index shows, with which class image and loss weight (tasks/train/concepts.py).

The dataset is one group per concept, one after the other: a group of n images shown r times each
with k class images is max(n * r, k) examples long; its example j shows slot j mod (n * r) and class
image j mod k of its own concept. With no concepts there is one group; with no repeats that is the
plain dataset (example j: image j mod n, class image j mod k). A pure function of the rows and
params: the epoch sampler, exact resume and the per-example generators (data.py) are unchanged by it.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """One concept's stretch of the dataset."""

    name: str | None  # None: the one group of a run without train.concepts
    slots: tuple[int, ...]  # instance indices, each as many times as it repeats
    classes: tuple[int, ...] = ()  # class image indices of this concept (empty: no prior preservation)
    prompt: Callable[..., str] | None = None  # None: the dataset's prompt function
    class_prompt: str | None = None  # None: the dataset's class prompt
    loss_weight: float = 1.0

    def __len__(self) -> int:
        return max(len(self.slots), len(self.classes))


def repeated(indices: Sequence[int], repeats: Sequence[int]) -> tuple[int, ...]:
    """Each index `repeats[k]` times: one pass over all, then again over those repeated more, ..."""
    most = max(repeats, default=0)
    return tuple(i for rep in range(most) for i, r in zip(indices, repeats) if r > rep)


class Layout:
    """Example index -> (group, instance index, class index or None), groups one after the other."""

    def __init__(self, groups: Sequence[Group]) -> None:
        self.groups = [g for g in groups if len(g)]
        self.starts, total = [], 0
        for group in self.groups:
            self.starts.append(total)
            total += len(group)
        self.length = total

    @classmethod
    def single(cls, repeats: Sequence[int], num_classes: int) -> Layout:
        """One group of every instance (each `repeats[i]` times) and every class image."""
        return cls([Group(None, repeated(range(len(repeats)), repeats), tuple(range(num_classes)))])

    def __len__(self) -> int:
        return self.length

    def locate(self, index: int) -> tuple[Group, int, int | None]:
        index %= self.length
        g = bisect.bisect_right(self.starts, index) - 1
        group, j = self.groups[g], index - self.starts[g]
        c = group.classes[j % len(group.classes)] if group.classes else None
        return group, group.slots[j % len(group.slots)], c

    def instance(self, index: int) -> int:
        return self.locate(index)[1]
