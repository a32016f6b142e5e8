"""Word lists, the country table and the train/held-out rule for every entity the corpus uses.

The split is a pure function of the entity (a stable hash of its text), so training and held-out
data never share a person's name, a word for string tools, a country, a number or a year, whatever
the seed.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")
HELDOUT_PERCENT = 20


def split_of(entity: str | int) -> Split:
    """Train or held-out, from a stable hash of the entity's text (about 20% held out). A number
    and its negative share a split, since both show the same digits."""
    text = str(abs(entity)) if isinstance(entity, int) else entity.lower()
    bucket = zlib.crc32(text.encode()) % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def in_split(values: tuple[str, ...], split: Split) -> tuple[str, ...]:
    return tuple(v for v in values if split_of(v) == split)


def number(rng: random.Random, low: int, high: int, split: Split) -> int:
    """A uniform integer in [low, high] whose split is `split` (rejection sampling)."""
    for _ in range(10_000):
        value = rng.randint(low, high)
        if split_of(value) == split:
            return value
    raise ValueError(f"no {split} number in [{low}, {high}]")


FIRST_NAMES = tuple(
    """
    Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Noah Olivia Paul
    Quinn Rosa Sam Tara Umar Vera Walter Xena Yusuf Zoe Aaron Bella Caleb Daisy Ethan Fiona
    George Hannah Isaac Julia Kevin Laura Mason Nina Oscar Peter Ruby Simon Tina Victor Wendy
    Adam Beth Chloe Daniel Elena Felix Gina Hugo Ivy Jonas Kira Liam Mila Nora Owen Pia Rhys
    Sofia Theo Uma Vince Willa Amir Bianca Cyrus Dora Elias Freya Gavin Helga Igor Jada Kofi
    Lena Marco Nadia Omar Priya Raul Sana Tomas Ursula Viktor Yara Zane Ada Boris Clara Dmitri
    Edith Farah Gustav Hiro Ingrid Jamal Kai Lucia Mateo Nell Otto Petra Rami Selma Tobias
    Vivian Wes Yuki Anton Celia Dario Enzo Flora Hector Iris Jorge Keiko Lars Mina Nils Ola
    Pedro Rita Sven Talia Ugo Wanda Ximena Zara Basil Cora
    """.split()
)

STRING_WORDS = tuple(
    """
    apple banana cherry garden window river mountain candle lantern pencil rocket planet silver
    thunder blossom castle dragon forest meadow pillow basket marble orange purple yellow winter
    summer autumn spring harbor island jungle kettle ladder mirror needle ocean parrot pepper
    puzzle rabbit saddle tunnel velvet wallet zebra anchor bridge cactus dinner engine falcon
    guitar hammer igloo jacket kitten lemon magnet napkin oyster pirate quartz ribbon sunset
    teapot umbrella violin walnut yogurt bottle button carpet cookie copper cotton dolphin
    feather flower ginger helmet honey insect jigsaw kayak locket meteor muffin noodle octopus
    paddle pebble pickle pumpkin quiver radish sandal shadow shovel spider stable stone sugar
    table tiger tomato tower turtle valley wagon whistle wizard acorn almond bamboo beacon
    biscuit blanket breeze bucket butter camel canvas carrot cedar chalk circus clover cobweb
    comet coral cradle crystal daisy desert diamond donkey eagle ember fabric fiddle fossil
    galaxy garlic glacier goblet gravel hazel hedge horizon iceberg ivory jasmine kernel kiwi
    lagoon lava lizard llama maple melody mitten monkey mossy nectar nutmeg olive orchid otter
    panda peanut pearl pigeon plume pony poppy quail raven reef robin saffron salmon scarf shell
    sparrow squid tulip tundra vapor walrus willow wren yarn zipper beetle canyon dune emerald
    forge grape heron jewel koala linen mango nickel onion prism quill rose satin thistle
    """.split()
)

REAL_COUNTRIES: tuple[tuple[str, str, int, str], ...] = (
    ("France", "Paris", 68_000_000, "euro"),
    ("Germany", "Berlin", 84_000_000, "euro"),
    ("Japan", "Tokyo", 124_000_000, "yen"),
    ("Brazil", "Brasilia", 203_000_000, "real"),
    ("Canada", "Ottawa", 40_000_000, "Canadian dollar"),
    ("Kenya", "Nairobi", 55_000_000, "Kenyan shilling"),
    ("Egypt", "Cairo", 111_000_000, "Egyptian pound"),
    ("India", "New Delhi", 1_430_000_000, "rupee"),
    ("Mexico", "Mexico City", 129_000_000, "peso"),
    ("Peru", "Lima", 34_000_000, "sol"),
    ("Norway", "Oslo", 5_500_000, "Norwegian krone"),
    ("Sweden", "Stockholm", 10_500_000, "Swedish krona"),
    ("Italy", "Rome", 59_000_000, "euro"),
    ("Spain", "Madrid", 48_000_000, "euro"),
    ("Portugal", "Lisbon", 10_400_000, "euro"),
    ("Greece", "Athens", 10_400_000, "euro"),
    ("Poland", "Warsaw", 37_000_000, "zloty"),
    ("Turkey", "Ankara", 85_000_000, "Turkish lira"),
    ("Australia", "Canberra", 26_000_000, "Australian dollar"),
    ("New Zealand", "Wellington", 5_200_000, "New Zealand dollar"),
    ("Argentina", "Buenos Aires", 46_000_000, "Argentine peso"),
    ("Chile", "Santiago", 19_600_000, "Chilean peso"),
    ("Nigeria", "Abuja", 224_000_000, "naira"),
    ("Ghana", "Accra", 34_000_000, "cedi"),
    ("Morocco", "Rabat", 37_000_000, "dirham"),
    ("Vietnam", "Hanoi", 99_000_000, "dong"),
    ("Thailand", "Bangkok", 72_000_000, "baht"),
    ("Indonesia", "Jakarta", 278_000_000, "rupiah"),
    ("Iceland", "Reykjavik", 390_000, "Icelandic krona"),
    ("Ireland", "Dublin", 5_300_000, "euro"),
    ("Austria", "Vienna", 9_100_000, "euro"),
    ("Hungary", "Budapest", 9_600_000, "forint"),
    ("Finland", "Helsinki", 5_600_000, "euro"),
    ("Denmark", "Copenhagen", 5_900_000, "Danish krone"),
    ("Switzerland", "Bern", 8_800_000, "Swiss franc"),
    ("South Korea", "Seoul", 51_700_000, "won"),
    ("Mongolia", "Ulaanbaatar", 3_400_000, "togrog"),
    ("Colombia", "Bogota", 52_000_000, "Colombian peso"),
    ("Cuba", "Havana", 11_000_000, "Cuban peso"),
    ("Nepal", "Kathmandu", 30_000_000, "Nepalese rupee"),
)

_ONSETS = "b br c d dr f g gr h k kl l m n p pr r s st t tr v z th sh".split()
_VOWELS = "a e i o u a e o ai".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "k", "th"]
_COUNTRY_ENDINGS = "ia land ania mark stan or eria una".split()
_CITY_ENDINGS = "ton burg port holm grad ville mouth ford dale".split()
_CURRENCIES = "crown mark florin ducat lira dinar thaler shilling guilder talent".split()
NUM_FICTIONAL_COUNTRIES = 20_000
_TABLE_SEED = 20240611  # the table is part of the tool, fixed for every corpus seed
_REAL_NAMES = frozenset(name.lower() for row in REAL_COUNTRIES for name in row[:2])


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    population: int
    currency: str
    split: Split  # real countries are all "train"; a fictional one's split is its name's


def pseudo_word(rng: random.Random, syllables: int) -> str:
    """A pronounceable made-up lowercase word."""
    parts = [
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    ]
    return "".join(parts)


def _fresh(rng: random.Random, split: Split, make: Callable[[], str], taken: Container[str]) -> str:
    """A string from `make` whose split is `split` and that is not taken (rejection sampling)."""
    while True:
        text = make()
        if (
            split_of(text) == split
            and text.lower() not in taken
            and text.lower() not in _REAL_NAMES
        ):
            return text


def _fictional_countries() -> list[Country]:
    rng = random.Random(_TABLE_SEED)
    taken: set[str] = set()
    countries: list[Country] = []
    while len(countries) < NUM_FICTIONAL_COUNTRIES:
        name = pseudo_word(rng, rng.randint(1, 2)).capitalize() + rng.choice(_COUNTRY_ENDINGS)
        if name.lower() in taken or name.lower() in _REAL_NAMES:
            continue
        split = split_of(name)
        capital = _fresh(rng, split, lambda: _city(rng), taken)
        taken.update((name.lower(), capital.lower()))
        population = rng.randint(50, 90_000) * 1000
        countries.append(Country(name, capital, population, rng.choice(_CURRENCIES), split))
    return countries


def _city(rng: random.Random) -> str:
    return pseudo_word(rng, rng.randint(1, 2)).capitalize() + rng.choice(_CITY_ENDINGS)


@functools.cache
def country_table() -> dict[str, Country]:
    """The lookup tool's table by lowercase name: real countries and 20,000 fictional ones."""
    real = [Country(n, c, p, cur, "train") for n, c, p, cur in REAL_COUNTRIES]
    return {country.name.lower(): country for country in real + _fictional_countries()}


@functools.cache
def countries_in(split: Split) -> tuple[Country, ...]:
    return tuple(c for c in country_table().values() if c.split == split)


def unknown_country_name(rng: random.Random, split: Split) -> str:
    """A made-up country that is not in the table (for the lookup tool's error path)."""

    def make() -> str:
        return pseudo_word(rng, 2).capitalize() + rng.choice(_COUNTRY_ENDINGS)

    return _fresh(rng, split, make, country_table())


def person_name(rng: random.Random, split: Split) -> str:
    """A first name: a common one, or a made-up one, so that names are copied, not memorized."""
    if rng.random() < 0.4:
        return rng.choice(in_split(FIRST_NAMES, split))
    return _fresh(rng, split, lambda: pseudo_word(rng, rng.randint(1, 3)).capitalize(), ())


def text_word(rng: random.Random, split: Split) -> str:
    """A word for the string tool: an English word, a made-up word, or random letters."""
    kind = rng.random()
    if kind < 0.4:
        return rng.choice(in_split(STRING_WORDS, split))
    if kind < 0.8:
        return _fresh(rng, split, lambda: pseudo_word(rng, rng.randint(1, 3)), ())
    letters = "abcdefghijklmnopqrstuvwxyz"
    return _fresh(rng, split, lambda: "".join(rng.choices(letters, k=rng.randint(3, 8))), ())
