"""The toy tool world: made-up people and cities, their corpus, and questions about them.

Everything is generated from a seed, so a world is reproducible byte for byte. The names are
invented syllable strings, so no pretrained knowledge can answer a question: facts must be
searched. The world's calendar and towns are small, so every number a solver copies (a year, a
population, an operand, a result) is below 1000: one token of the toy tokenizer, copied in one
step (etagent.toy.model). The arithmetic still needs Python: a tiny model cannot multiply 37 by
24, add three 3-digit numbers or take a remainder in its head. The four kinds of question are what the paper's behaviour calibration is about:

- ``search``: one fact about one entity (needs exactly one search);
- ``python``: arithmetic on numbers given in the question (needs exactly one Python call);
- ``both``: a fact to look up, then arithmetic on it (one search, then one Python call);
- ``none``: answerable from the question itself (needs no tool).

Search questions are scored as QA (F1), the others with numeric answers as math. ``none``
questions ask for part of a name, so they are QA.

What this module does not do: write trajectories (``etagent.toy.seeds``) or build the model.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from etagent.records import Question

KINDS = ("search", "python", "both", "none")

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "th", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
_CODAS = ["", "", "l", "n", "r", "s", "th", "k", "m", "v"]
_CITY_SUFFIXES = ["port", "ford", "haven", "mere", "wick", "stead", "holm", "gate"]
PROFESSIONS = [
    "cartographer",
    "glassblower",
    "astronomer",
    "beekeeper",
    "clockmaker",
    "weaver",
    "sculptor",
    "botanist",
    "shipwright",
    "bookbinder",
    "violinist",
    "mapmaker",
    "engraver",
    "potter",
    "lighthouse keeper",
    "tanner",
    "falconer",
    "chemist",
    "surveyor",
    "poet",
]


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(_syllable(rng) for _ in range(syllables)).capitalize()


@dataclass
class City:
    """A city; its passage states each fact in a sentence of its own, and a solver's reasoning
    quotes that sentence as it stands (copying a contiguous span is what a tiny model learns
    first)."""

    name: str
    river: str
    founded: int
    population: int

    @property
    def title(self) -> str:
        return self.name

    def passage(self) -> str:
        return (
            f"{self.name} is a city on the river {self.river}. "
            f"{self.name} was founded in {self.founded}. {self.name} has {self.population} inhabitants."
        )


@dataclass
class Person:
    first: str
    last: str
    born: int
    city: str
    profession: str

    @property
    def name(self) -> str:
        return f"{self.first} {self.last}"

    @property
    def title(self) -> str:
        return self.name

    @property
    def works_as(self) -> str:
        # Worded unlike the question ("What is the profession of X?"), as the other facts are, so
        # the words before the value in the reasoning match the result and not the question.
        article = "an" if self.profession[0] in "aeiou" else "a"
        return f"{self.name} works as {article} {self.profession}"

    def passage(self) -> str:
        return f"{self.works_as}. {self.name} was born in {self.born}. {self.name} was born in the city of {self.city}."


@dataclass
class World:
    seed: int
    cities: list[City] = field(default_factory=list)
    people: list[Person] = field(default_factory=list)

    def with_redrawn_facts(self, rng: random.Random) -> World:
        """The same people, cities and rivers with every fact drawn anew (years, populations,
        professions, home cities, which river a city is on).

        Training questions are asked in such versions of the world, held-out questions in the
        served one: a policy cannot learn who was born when from its training data and must read
        it from its search results. Without this a tiny model learns the facts of the training
        trajectories and recites them, wrongly, for held-out questions about the same people.
        """
        rivers = [c.river for c in self.cities]
        rng.shuffle(rivers)
        cities = [
            City(c.name, river, founded=rng.randint(100, 899), population=rng.randint(100, 599)) for c, river in zip(self.cities, rivers)
        ]
        people = [
            Person(p.first, p.last, born=rng.randint(100, 899), city=rng.choice(cities).name, profession=rng.choice(PROFESSIONS))
            for p in self.people
        ]
        return World(seed=self.seed, cities=cities, people=people)

    def made_up_words(self) -> list[str]:
        """Every word of the world that a solver copies rather than writes: names of people,
        cities and rivers, and the profession words (``lighthouse keeper`` is two)."""
        names = {p.first for p in self.people} | {p.last for p in self.people}
        names |= {c.name for c in self.cities} | {c.river for c in self.cities}
        return sorted(names | {word for profession in PROFESSIONS for word in profession.split()})

    def corpus(self) -> list[dict]:
        """The retrieval corpus in the FlashRAG/Search-R1 format: ``contents`` is the quoted title,
        a newline and the passage."""
        docs = []
        for i, entity in enumerate(self.people + self.cities):
            docs.append({"id": str(i), "title": entity.title, "contents": f'"{entity.title}"\n{entity.passage()}'})
        return docs


def make_world(seed: int, n_people: int, n_cities: int) -> World:
    """A world of n_people people living in n_cities cities, with unique names."""
    rng = random.Random(seed)
    used: set[str] = set()

    def fresh(make) -> str:
        while True:
            name = make()
            if name not in used and name.lower() not in used:
                used.add(name)
                used.add(name.lower())
                return name

    world = World(seed=seed)
    for _ in range(n_cities):
        name = fresh(lambda: _word(rng, rng.choice([1, 2])) + rng.choice(_CITY_SUFFIXES))
        river = fresh(lambda: _word(rng, 2))
        world.cities.append(City(name, river, founded=rng.randint(100, 899), population=rng.randint(100, 599)))
    for _ in range(n_people):
        first = _word(rng, 2)
        last = fresh(lambda: _word(rng, 2))
        world.people.append(
            Person(first, last, born=rng.randint(100, 899), city=rng.choice(world.cities).name, profession=rng.choice(PROFESSIONS))
        )
    return world


# ---------------------------------------------------------------------------------------------
# Questions


@dataclass
class ToyQuestion:
    """A question with what an efficient solver does: the searches and the code it needs."""

    question: Question
    toy_kind: str  # search, python, both, none
    searches: list[str]  # queries an efficient solver sends, in order
    code: str | None  # the Python an efficient solver runs (after the searches), or None
    fact: str | None  # the looked-up value the reasoning quotes ("born in 1873"), if any
    entity: str | None = None


def _search_question(rng: random.Random, world: World) -> tuple[str, str, str, str]:
    """(question, answer, entity, fact phrase) for a one-fact lookup."""
    if rng.random() < 0.7:
        p = rng.choice(world.people)
        template = rng.choice(["born", "profession", "city"])
        if template == "born":
            return f"In which year was {p.name} born?", str(p.born), p.name, f"{p.name} was born in {p.born}"
        if template == "profession":
            return f"What is the profession of {p.name}?", p.profession, p.name, p.works_as
        return f"In which city was {p.name} born?", p.city, p.name, f"{p.name} was born in the city of {p.city}"
    c = rng.choice(world.cities)
    if rng.random() < 0.5:
        return f"On which river is {c.name}?", c.river, c.name, f"{c.name} is a city on the river {c.river}"
    return f"In which year was {c.name} founded?", str(c.founded), c.name, f"{c.name} was founded in {c.founded}"


def arithmetic_question(rng: random.Random) -> tuple[str, str, str]:
    """(question, answer, code) for arithmetic on numbers in the question; every number < 1000."""
    form = rng.choice(["product", "sum", "remainder"])
    if form == "product":
        a = rng.randint(11, 90)
        b = rng.randint(11, 999 // a)
        return f"What is {a} multiplied by {b}?", str(a * b), f"print({a} * {b})"
    if form == "sum":
        a, b, c = (rng.randint(100, 333) for _ in range(3))
        return f"What is the sum of {a}, {b} and {c}?", str(a + b + c), f"print({a} + {b} + {c})"
    a, b = rng.randint(100, 999), rng.randint(11, 99)
    return f"What is the remainder of {a} divided by {b}?", str(a % b), f"print({a} % {b})"


def _both_question(rng: random.Random, world: World) -> tuple[str, str, str, str, str]:
    """(question, answer, entity, fact phrase, code): look up a number, then compute with it."""
    if rng.random() < 0.6:
        p = rng.choice(world.people)
        year = rng.randint(900, 999)
        return (
            f"How old would {p.name} be in the year {year}?",
            str(year - p.born),
            p.name,
            f"{p.name} was born in {p.born}",
            f"print({year} - {p.born})",
        )
    c = rng.choice(world.cities)
    k = rng.randint(100, 399)
    return (
        f"How many inhabitants would {c.name} have with {k} more?",
        str(c.population + k),
        c.name,
        f"{c.name} has {c.population} inhabitants",
        f"print({c.population} + {k})",
    )


def _none_question(rng: random.Random, world: World) -> tuple[str, str, str]:
    """(question, answer, entity) answerable from the question text alone."""
    p = rng.choice(world.people)
    if rng.random() < 0.5:
        return f"What is the first name of the {p.profession} {p.name}?", p.first, p.name
    return f"What is the family name of the {p.profession} {p.name}?", p.last, p.name


def make_questions(world: World, rng: random.Random, counts: Mapping[str, int], prefix: str, exclude: set[str]) -> list[ToyQuestion]:
    """``counts[kind]`` questions of each kind whose text is not in ``exclude`` (which is updated)."""
    out: list[ToyQuestion] = []
    for kind in KINDS:
        per_kind, made, repeats = counts[kind], 0, 0
        while made < per_kind:
            if kind == "search":
                text, answer, entity, fact = _search_question(rng, world)
                searches, code, src_kind = [entity], None, "qa"
            elif kind == "python":
                text, answer, code = arithmetic_question(rng)
                entity, fact, searches, src_kind = None, None, [], "math"
            elif kind == "both":
                text, answer, entity, fact, code = _both_question(rng, world)
                searches, src_kind = [entity], "math"
            else:
                text, answer, entity = _none_question(rng, world)
                fact, code, searches, src_kind = None, None, [], "qa"
            if text in exclude:
                # search and none questions are bounded by the world's entities: fail clearly
                # instead of looping when more are asked for than the world can phrase.
                repeats += 1
                if repeats > 1000 * per_kind:
                    raise ValueError(f"the world has fewer than {per_kind} distinct {kind!r} questions left; add people or cities")
                continue
            exclude.add(text)
            qid = f"{prefix}-{kind}-{made:04d}"
            needed = {"search": len(searches), "python": int(code is not None)}
            question = Question(id=qid, question=text, answer=[answer], source=f"toy_{kind}", kind=src_kind, needed_calls=needed)
            out.append(ToyQuestion(question, kind, searches, code, fact, entity))
            made += 1
    return out
