"""Reasoning Gym datasets as task sources: `create_tasks(name, size=..., seed=..., **options)` builds ANY registered
Reasoning Gym dataset by name (`reasoning_gym.create_dataset`), yields `TaskItem(question, entry)` items and scores
an answer with that dataset's own `score_answer(answer, entry)`. Nothing here knows a particular dataset: `options`
are the dataset's config fields (e.g. basic_arithmetic's `min_digits`, `max_digits`, `min_terms`, `operators`) and
go to it unchanged; `entry` is the dataset's own dict (its "question", "answer" and "metadata"), kept whole so that
scoring and anything reading its metadata see what the dataset wrote.

Reasoning Gym is an optional dependency (`pip install -e ".[tasks]"`): this module imports without it, and
`create_tasks` / `dataset_names` import it when first called, raising ImportError naming the extra if it is missing.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from typing import Any

INSTALL_HINT = 'pip install -e ".[tasks]"'


@dataclasses.dataclass(frozen=True)
class TaskItem:
    question: str  # the text to show the policy
    entry: Mapping[str, Any]  # the dataset's own entry; pass it back to `ReasoningGymTasks.score`


@dataclasses.dataclass(frozen=True)
class ReasoningGymTasks:
    """`size` items of one Reasoning Gym dataset, drawn from `seed`; item i is the same for the same name, size,
    seed and options."""

    name: str
    size: int
    seed: int
    options: Mapping[str, Any]
    dataset: Any  # the reasoning_gym dataset (a ProceduralDataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> TaskItem:
        entry = self.dataset[index]
        return TaskItem(question=entry["question"], entry=entry)

    def __iter__(self) -> Iterator[TaskItem]:
        return (self[i] for i in range(len(self)))

    def score(self, answer: str | None, entry: Mapping[str, Any]) -> float:
        """The dataset's own score of `answer` (the policy's final answer text; None when it gave none) for
        `entry`, in [0, 1]: 1.0 for a correct answer."""
        return float(self.dataset.score_answer(answer, entry))


def create_tasks(name: str, *, size: int, seed: int, **options: Any) -> ReasoningGymTasks:
    """The Reasoning Gym dataset `name` with `size` items drawn from `seed`, configured by `options` (its config's
    fields). Raises ValueError for an unregistered name (with the closest registered ones), TypeError for an option
    its config does not have."""
    reasoning_gym = _import_reasoning_gym()
    names = dataset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = (
            f"; did you mean {', '.join(close)}?" if close else f" ({len(names)} are registered: see dataset_names())"
        )
        raise ValueError(f"no Reasoning Gym dataset named {name!r}{hint}")
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
    except TypeError as error:
        raise TypeError(f"Reasoning Gym dataset {name!r}: {error}") from None
    return ReasoningGymTasks(name=name, size=size, seed=seed, options=dict(options), dataset=dataset)


def dataset_names() -> tuple[str, ...]:
    """Every registered Reasoning Gym dataset name, sorted."""
    return tuple(sorted(_import_reasoning_gym().factory.DATASETS))


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(
            f"Reasoning Gym tasks need the reasoning-gym package; install it with: {INSTALL_HINT}"
        ) from error
    return reasoning_gym
