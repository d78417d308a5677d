"""The search agent's world: a corpus of short encyclopedia entries generated from a seed (nothing downloaded), and
questions whose answers need one or two lookups in it. Pure: the same seed gives the same corpus and questions.

People are born in towns, towns lie in regions; an entry says one fact. "Where was X born?" needs X's entry;
"In which region was X born?" needs X's entry, then the town's. Names are made of invented syllables, so a
model cannot know the answers: it has to search. One person in five is held out: their questions are never asked
in training (`Question.held_out`), so an evaluation on them needs names the model has never seen.
"""

from __future__ import annotations

import dataclasses
import random

_SYLLABLES = ["ka", "lo", "mi", "ra", "ve", "to", "sun", "dor", "bel", "an", "ri", "zo", "ma", "ne", "qu", "il"]
JOBS = ["a potter", "a sailor", "a weaver", "a miller", "a clockmaker", "a beekeeper", "a cartographer", "a baker"]


@dataclasses.dataclass(frozen=True)
class Question:
    id: str
    text: str
    answer: str
    hops: int
    held_out: bool


@dataclasses.dataclass(frozen=True)
class World:
    documents: list[str]
    questions: list[Question]


def _name(rng: random.Random, used: set[str], parts: int, *, unique: bool = True) -> str:
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()
        if name not in used:
            if unique:
                used.add(name)
            return name


def build(seed: int = 0, *, people: int = 400, towns: int = 40, regions: int = 8) -> World:
    """Place names and family names are unique; first names repeat but never name a place."""
    rng = random.Random(seed)
    used: set[str] = set()
    region_names = [_name(rng, used, 3) for _ in range(regions)]
    town_region = {_name(rng, used, 2): rng.choice(region_names) for _ in range(towns)}
    docs = [f"{town} is a town in the region of {region}." for town, region in town_region.items()]
    docs += [f"{region} is a region with {sum(r == region for r in town_region.values())} towns." for region in
             region_names]
    questions = []
    for i in range(people):
        person = f"{_name(rng, used, 2, unique=False)} {_name(rng, used, 3)}"
        town = rng.choice(list(town_region))
        docs.append(f"{person} was {rng.choice(JOBS)} born in {town}.")
        held_out = i % 5 == 0
        questions.append(Question(f"born-{i}", f"Where was {person} born?", town, 1, held_out))
        questions.append(Question(f"region-{i}", f"In which region was {person} born?", town_region[town], 2, held_out))
    rng.shuffle(docs)
    return World(docs, questions)
