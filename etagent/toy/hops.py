"""The hard toy world: questions that chain 0 to 4 lookups (hops) through people and cities,
facts a policy can learn (landmarks) beside facts only the corpus holds, and seed trajectories
that cover only part of the question shapes.

Designed in docs/toy-world.md ("A world with headroom"), where each of the method's components is
given the lever in this world that it should pull. The toy world (etagent.toy.world) is solved
by RL, so every ablation ends in the same place; this one is built so that they need not.

- **Shapes.** A question's shape is its hop count and whether it ends in arithmetic:
  ``hops0`` (the answer is in the question), ``hops0_python`` (arithmetic on numbers in the
  question), ``hops2`` ("On which river is the home city of X?": X's document, then the city's),
  ``hops3_python`` ("How old would the mentor of the mayor of Dunmere be in the year 950?").
  A hop is one entity's document; each hop's fact names the next entity.
- **Landmarks.** The first ``landmark_people`` people and ``landmark_cities`` cities keep their
  facts in every version of the world (training versions, the RL world, the served one), and the
  seeds recite their facts from memory: a policy can learn them. Every other fact is redrawn per
  version and must be searched. ``needed_calls`` counts the searches of non-landmarks only, so a
  policy can over-call (search a landmark) and under-call (guess a redrawn fact) on one question.
- **Seeds** (``write_hop_trajectory``) follow the toy's three habits (efficient, redundant,
  insufficient); which shapes get seeds is the build's setting (the flywheel's shapes get none).

Every number a solver copies is below 1000 and every made-up word one token, as in the toy.

What this module does not do: write files or choose counts (etagent.toy.build), build the model.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from etagent import protocol
from etagent.records import Provenance, Question, Trajectory
from etagent.scoring import rule_judgement
from etagent.toy.seeds import ToySearch, TrajectoryBuilder
from etagent.toy.world import PROFESSIONS, arithmetic_question, make_world

SHAPE = re.compile(r"hops([0-4])(_python)?")
MAX_HOPS = 4


def parse_shape(shape: str) -> tuple[int, bool]:
    """``hops3_python`` -> (3, True); a ValueError for anything else."""
    match = SHAPE.fullmatch(shape)
    if match is None:
        raise ValueError(f"{shape!r} is not a question shape (hops0 to hops{MAX_HOPS}, optionally _python)")
    return int(match.group(1)), match.group(2) is not None


@dataclass
class HopPerson:
    first: str
    last: str
    born: int
    city: str
    profession: str
    mentor: str
    landmark: bool = False

    @property
    def name(self) -> str:
        return f"{self.first} {self.last}"

    def facts(self) -> dict[str, str]:
        """Each fact's sentence, as the passage states it and the reasoning quotes it: every one
        starts with the entity's name, so the value follows words the reasoning has just copied."""
        article = "an" if self.profession[0] in "aeiou" else "a"
        return {
            "profession": f"{self.name} works as {article} {self.profession}",
            "born": f"{self.name} was born in {self.born}",
            "city": f"{self.name} was born in the city of {self.city}",
            "mentor": f"{self.name} studied under {self.mentor}",
        }


@dataclass
class HopCity:
    name: str
    river: str
    founded: int
    population: int
    mayor: str
    landmark: bool = False

    def facts(self) -> dict[str, str]:
        return {
            "river": f"{self.name} is a city on the river {self.river}",
            "founded": f"{self.name} was founded in {self.founded}",
            "population": f"{self.name} has {self.population} inhabitants",
            "mayor": f"{self.name} is governed by the mayor {self.mayor}",
        }


# The relations a chain follows (an entity's fact that names another entity) and the attribute a
# chain ends in, with the kind of entity each starts from.
RELATIONS = {"person": {"mentor": "person", "city": "city"}, "city": {"mayor": "person"}}
NUMERIC = {"person": ["born"], "city": ["founded", "population"]}
ANSWERS = {"person": ["born", "city", "mentor"], "city": ["river", "founded", "population", "mayor"]}


@dataclass
class HopWorld:
    people: list[HopPerson]
    cities: list[HopCity]
    by_name: dict[str, HopPerson | HopCity] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_name = {p.name: p for p in self.people} | {c.name: c for c in self.cities}

    def entity(self, name: str) -> HopPerson | HopCity:
        return self.by_name[name]

    def corpus(self) -> list[dict]:
        """The retrieval corpus in the FlashRAG format (``contents``: the quoted title, a newline
        and the passage: each fact a sentence of its own)."""
        docs = []
        for i, entity in enumerate(self.people + self.cities):
            passage = " ".join(f"{sentence}." for sentence in entity.facts().values())
            docs.append({"id": str(i), "title": entity.name, "contents": f'"{entity.name}"\n{passage}'})
        return docs

    def made_up_words(self) -> list[str]:
        """Every word a solver copies rather than writes (names, rivers, profession words)."""
        words = {p.first for p in self.people} | {p.last for p in self.people}
        words |= {c.name for c in self.cities} | {c.river for c in self.cities}
        return sorted(words | {word for profession in PROFESSIONS for word in profession.split()})

    def with_redrawn_facts(self, rng: random.Random) -> HopWorld:
        """The same names with every fact of every non-landmark drawn anew (a landmark keeps its
        own facts, though the entities they name may not keep theirs)."""
        rivers = [c.river for c in self.cities if not c.landmark]
        rng.shuffle(rivers)
        free_rivers = iter(rivers)
        cities = [
            c
            if c.landmark
            else HopCity(c.name, next(free_rivers), rng.randint(100, 899), rng.randint(100, 599), rng.choice(self.people).name)
            for c in self.cities
        ]
        people = [
            p
            if p.landmark
            else HopPerson(
                p.first,
                p.last,
                rng.randint(100, 899),
                rng.choice(cities).name,
                rng.choice(PROFESSIONS),
                _mentor(rng, self.people, p),
            )
            for p in self.people
        ]
        return HopWorld(people=[replace(p) for p in people], cities=[replace(c) for c in cities])


def _mentor(rng: random.Random, people: list[HopPerson], of: HopPerson) -> str:
    while True:
        mentor = rng.choice(people)
        if mentor.name != of.name:
            return mentor.name


def make_hop_world(seed: int, n_people: int, n_cities: int, landmark_people: int, landmark_cities: int) -> HopWorld:
    """The toy's names and facts (etagent.toy.world.make_world with the same seed), each person
    given a mentor and each city a mayor; the first people and cities are the landmarks. A
    landmark's mentor or mayor is another landmark half of the time, so chains through landmarks
    run on through what a policy can know."""
    base = make_world(seed, n_people, n_cities)
    rng = random.Random(f"{seed}-hops")
    people = [HopPerson(p.first, p.last, p.born, p.city, p.profession, "", landmark=i < landmark_people) for i, p in enumerate(base.people)]
    landmarks = people[:landmark_people]
    for person in people:
        if person.landmark and len(landmarks) > 1 and rng.random() < 0.5:
            person.mentor = _mentor(rng, landmarks, person)
        else:
            person.mentor = _mentor(rng, people, person)
    cities = []
    for i, c in enumerate(base.cities):
        landmark = i < landmark_cities
        mayor = rng.choice(landmarks if landmark and landmarks and rng.random() < 0.5 else people).name
        cities.append(HopCity(c.name, c.river, c.founded, c.population, mayor, landmark=landmark))
    return HopWorld(people=people, cities=cities)


# ---------------------------------------------------------------------------------------------
# Questions


@dataclass
class HopStep:
    """One hop: the entity whose document holds the fact, the fact's sentence, and its value."""

    entity: str
    landmark: bool
    sentence: str
    value: str


@dataclass
class HopQuestion:
    question: Question
    shape: str
    steps: list[HopStep]  # the chain, in order (empty for 0 hops)
    code: str | None  # the Python an efficient solver runs after the chain, or None
    entity: str | None = None  # the person a 0-hop question names (what over-calling searches)


_PHRASES = {"mentor": "the mentor of {}", "city": "the home city of {}", "mayor": "the mayor of {}"}
_ASKS = {
    "born": "In which year was {} born?",
    "city": "In which city was {} born?",
    "mentor": "Who is the mentor of {}?",
    "river": "On which river is {}?",
    "founded": "In which year was {} founded?",
    "population": "How many inhabitants does {} have?",
    "mayor": "Who is the mayor of {}?",
}


def _chain(rng: random.Random, world: HopWorld, hops: int, numeric_end: bool, landmark_start: float) -> tuple[list[str], list, str]:
    """A random walk of ``hops`` entities: (relations followed, entities visited, final attribute).
    The walk starts at a landmark with probability ``landmark_start``."""
    for _ in range(1000):
        kind = rng.choice(["person", "city"])
        pool = world.people if kind == "person" else world.cities
        landmarks = [e for e in pool if e.landmark]
        entity = rng.choice(landmarks if landmarks and rng.random() < landmark_start else pool)
        relations, visited = [], [entity]
        for _ in range(hops - 1):
            relation, kind = rng.choice(list(RELATIONS[kind].items()))
            entity = world.entity(getattr(entity, relation))
            relations.append(relation)
            visited.append(entity)
        ends = NUMERIC[kind] if numeric_end else ANSWERS[kind]
        if len({e.name for e in visited}) == hops:  # no entity twice (a mentor's mentor who is oneself)
            return relations, visited, rng.choice(ends)
    raise ValueError(f"no chain of {hops} distinct entities in this world")


def make_hop_question(
    rng: random.Random, world: HopWorld, shape: str, landmark_start: float
) -> tuple[str, str, list[HopStep], str | None, str | None]:
    """(question, answer, chain, code, the person a 0-hop question names) of a shape."""
    hops, python = parse_shape(shape)
    if hops == 0:
        if python:
            text, answer, code = arithmetic_question(rng)
            return text, answer, [], code, None
        p = rng.choice(world.people)
        part = rng.choice(["first", "family"])
        return f"What is the {part} name of the {p.profession} {p.name}?", p.first if part == "first" else p.last, [], None, p.name
    relations, visited, attribute = _chain(rng, world, hops, python, landmark_start)
    phrase = visited[0].name
    steps = []
    for entity, relation in zip(visited, relations + [attribute]):
        value = str(getattr(entity, relation))
        steps.append(HopStep(entity.name, entity.landmark, entity.facts()[relation], value))
    for relation in relations:
        phrase = _PHRASES[relation].format(phrase)
    value = steps[-1].value
    if not python:
        return _ASKS[attribute].format(phrase), value, steps, None, None
    if attribute == "population":
        k = rng.randint(100, 399)
        return f"How many inhabitants would {phrase} have with {k} more?", str(int(value) + k), steps, f"print({value} + {k})", None
    year = rng.randint(900, 999)
    return f"How old would {phrase} be in the year {year}?", str(year - int(value)), steps, f"print({year} - {value})", None


def make_hop_questions(
    world: HopWorld, rng: random.Random, counts: Mapping[str, int], prefix: str, exclude: set[str], landmark_start: float
) -> list[HopQuestion]:
    """``counts[shape]`` questions of each shape whose text is not in ``exclude`` (updated)."""
    out = []
    for shape, wanted in counts.items():
        made, repeats = 0, 0
        while made < wanted:
            text, answer, steps, code, entity = make_hop_question(rng, world, shape, landmark_start)
            if text in exclude:
                repeats += 1
                if repeats > 1000 * wanted:
                    raise ValueError(f"the world has fewer than {wanted} distinct {shape!r} questions left; add people or cities")
                continue
            exclude.add(text)
            needed = {"search": sum(not step.landmark for step in steps), "python": int(code is not None)}
            kind = "math" if code is not None else "qa"
            question = Question(
                id=f"{prefix}-{shape}-{made:04d}", question=text, answer=[answer], source=f"toy_{shape}", kind=kind, needed_calls=needed
            )
            out.append(HopQuestion(question, shape, steps, code, entity))
            made += 1
    return out


# ---------------------------------------------------------------------------------------------
# Seed trajectories


def _plan(q: HopQuestion, behaviour: str, rng: random.Random) -> list[tuple[str, int | None]]:
    """The trajectory's moves in order, each (move, step): ``search`` a step's entity, ``recall`` a
    landmark's fact from memory, ``search-known`` a landmark's entity anyway, ``search-again`` or
    ``python-again`` a call already made, ``python``."""
    plan: list[tuple[str, int | None]] = [("recall" if s.landmark else "search", i) for i, s in enumerate(q.steps)]
    if q.code is not None:
        plan.append(("python", None))
    if behaviour != "redundant":
        return plan
    calls = [i for i, (move, _) in enumerate(plan) if move != "recall"]
    recalls = [i for i, (move, _) in enumerate(plan) if move == "recall"]
    if not calls and not recalls:  # nothing is needed: the redundant habit is to search anyway
        return [("search-anyway", None)]
    if recalls and (not calls or rng.random() < 0.5):  # search a fact the policy knows
        at = rng.choice(recalls)
        plan[at] = ("search-known", plan[at][1])
        return plan
    at = rng.choice(calls)
    plan.insert(at + 1, (f"{plan[at][0]}-again", plan[at][1]))
    return plan


_ANNOUNCE = {
    "search-known": " To be sure, I will search even for what I know.",
    "search-again": " To be sure, I will search for it twice.",
    "python-again": " To be safe, I will run the calculation twice.",
}


def write_hop_trajectory(q: HopQuestion, behaviour: str, search: ToySearch, rng: random.Random) -> Trajectory:
    """One seed trajectory of a behaviour (efficient, redundant, insufficient; a question that
    needs no call cannot be under-served, so it gets efficient) for a hard-world question. The
    over-calling habit is announced in the first thought, as in the toy's seeds."""
    needs_a_call = any(not s.landmark for s in q.steps) or q.code is not None
    if behaviour == "insufficient" and not needs_a_call:
        behaviour = "efficient"
    b = TrajectoryBuilder(search)
    pick = rng.choice
    answer = q.question.answer[0]
    plan = [] if behaviour == "insufficient" else _plan(q, behaviour, rng)
    if behaviour == "insufficient":
        b.think(pick(["I think I know this without any tool.", "I can answer this directly."]) + f" The answer should be {answer}.")
    elif not q.steps and q.code is None:
        b.think(pick(["The answer is already in the question.", "The question itself contains the answer."]))
    announce = next((_ANNOUNCE[move] for move, _ in plan if move in _ANNOUNCE), "")
    if announce and plan[0][0] == "recall":
        b.think("I will follow the question one fact at a time." + announce)
        announce = ""
    for move, at in plan:
        step = q.steps[at] if at is not None else None
        if move == "search-anyway":
            b.think(f"Let me look up {q.entity} first.")
            b.call(protocol.SEARCH, q.entity)
            b.think("The search does not change anything: the answer is in the question.")
        elif move == "recall":
            b.think(f"I know that {step.sentence}.")
        elif move in ("search", "search-known"):
            b.think(
                pick([f"I need to look up {step.entity}.", f"I do not know this fact about {step.entity}, so I will search for it."])
                + announce
            )
            announce = ""
            b.call(protocol.SEARCH, step.entity)
            b.think(f"The result says that {step.sentence}.")
        elif move == "search-again":
            b.think(pick([f"Let me search for {step.entity} again to be sure.", "I will search once more to double-check."]))
            b.call(protocol.SEARCH, step.entity)
            b.think(f"The result again says that {step.sentence}.")
        elif move == "python":
            b.think(pick(["This needs exact arithmetic, so I will use Python.", "I will compute this with Python."]) + announce)
            announce = ""
            b.think(f"Python gives {b.call(protocol.PYTHON, q.code)}.")
        else:  # python-again
            b.think(pick(["Let me check this calculation once more.", "I will run the calculation again to be safe."]))
            b.think(f"Python again gives {b.call(protocol.PYTHON, q.code)}.")
    b.answer(answer)
    prediction = protocol.extract_answer(b.text)
    return Trajectory(
        id="",
        text=b.text,
        tool_calls=list(b.calls),
        prediction=prediction,
        judgement=rule_judgement(prediction, q.question.answer, q.question.kind, qa_pass_mark=1.0),
        finish_reason="answer",
        provenance=Provenance(stage="toy", operation="seed", behaviour=behaviour),
    )
