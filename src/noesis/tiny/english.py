"""Plain English for the corpus: templated sentences, short stories and paragraphs, so that the
model's free text (analysis, final answers) is grammatical rather than gibberish. No downloads."""

from __future__ import annotations

import random

ANIMALS = tuple(
    """cat dog fox owl rabbit horse bear deer duck goat mouse frog lion tiger wolf otter panda
    turtle squirrel hedgehog pony sheep crow swan beaver badger whale dolphin penguin
    parrot""".split()
)
COLORS = tuple("red blue green yellow orange purple brown white black grey pink golden".split())
ADJECTIVES = tuple(
    """small big quiet happy clever brave sleepy curious gentle busy old young kind shy proud
    friendly tired hungry cheerful careful""".split()
)
PLACES = tuple(
    """park forest river garden village market library kitchen beach hill farm school station
    meadow harbor bakery museum lake field bridge""".split()
)
TIMES = tuple(
    """morning afternoon evening night weekend spring summer autumn winter holiday""".split()
)
FOODS = tuple("bread apples soup cheese rice pears carrots cake berries noodles honey eggs".split())
OBJECTS = tuple(
    """book ball kite lamp map letter basket hat box key bell cup coat drum boat""".split()
)
WEATHER = (
    "it was sunny",
    "it was raining",
    "the wind was cold",
    "the sky was clear",
    "snow covered the ground",
    "the air was warm",
    "clouds moved across the sky",
    "a light fog hid the hills",
)
# (present, past) pairs of verbs that take an object.
ACTIONS = (
    ("finds", "found"),
    ("carries", "carried"),
    ("paints", "painted"),
    ("shares", "shared"),
    ("fixes", "fixed"),
    ("hides", "hid"),
    ("buys", "bought"),
    ("makes", "made"),
    ("cleans", "cleaned"),
    ("opens", "opened"),
)
FACTS = (
    "The sun rises in the east and sets in the west.",
    "Water freezes at zero degrees Celsius.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "A week has seven days.",
    "There are twelve months in a year.",
    "Most birds can fly, but penguins cannot.",
    "Plants need light and water to grow.",
    "The moon goes around the earth.",
    "A triangle has three sides.",
    "A square has four equal sides.",
    "Bees make honey from the nectar of flowers.",
    "Ice is lighter than water, so it floats.",
    "An hour has sixty minutes.",
    "A minute has sixty seconds.",
    "Leaves often turn yellow and red in autumn.",
    "Fish breathe through their gills.",
    "A year usually has three hundred sixty five days.",
    "The ocean is salty, but most rivers are not.",
    "Sound travels faster in water than in air.",
    "A kilometer is one thousand meters.",
    "Metal feels cold because it carries heat away from the hand.",
    "Rain falls when water drops in the clouds grow heavy.",
    "Owls hunt at night and sleep during the day.",
    "Many trees lose their leaves in winter.",
)

_SENTENCES = (
    "{Name} walked to the {place} in the {time}.",
    "The {adj} {animal} sat near the {place}.",
    "{Name} {past} a {color} {obj} at the {place}.",
    "In the {time}, {weather}.",
    "{Name} likes to eat {food} with friends.",
    "A {adj} {animal} lives near the {place}.",
    "Every {time}, {Name} visits the {place}.",
    "{Name} and {Other} {past} the old {obj} together.",
    "The {obj} was {color} and very {adj2}.",
    "{Name} smiled because {weather}.",
    "The {animal} looked {adj} after a long day.",
    "There was a {color} {obj} on the table.",
    "{Name} read a book about a {adj} {animal}.",
    "At the {place}, {Name} met a {adj} {animal}.",
    "{Name} asked {Other} to bring some {food}.",
)


def _slots(rng: random.Random, names: tuple[str, ...]) -> dict[str, str]:
    name, other = rng.sample(names, 2)
    return {
        "Name": name,
        "Other": other,
        "animal": rng.choice(ANIMALS),
        "adj": rng.choice(ADJECTIVES),
        "adj2": rng.choice(("old", "new", "heavy", "light", "pretty", "clean", "useful")),
        "place": rng.choice(PLACES),
        "time": rng.choice(TIMES),
        "color": rng.choice(COLORS),
        "obj": rng.choice(OBJECTS),
        "food": rng.choice(FOODS),
        "weather": rng.choice(WEATHER),
        "past": rng.choice(ACTIONS)[1],
    }


def sentence(rng: random.Random, names: tuple[str, ...]) -> str:
    return rng.choice(_SENTENCES).format(**_slots(rng, names))


def about(rng: random.Random, animal: str) -> str:
    """One sentence about an animal."""
    templates = (
        "The {adj} {animal} ran across the {place} in the {time}.",
        "A {animal} is a {adj} animal that likes the {place}.",
        "The {color} {animal} slept quietly near the {place}.",
        "Every {time}, a {adj} {animal} comes to the {place} to look for {food}.",
    )
    slots = {
        "animal": animal,
        "adj": rng.choice(ADJECTIVES),
        "place": rng.choice(PLACES),
        "time": rng.choice(TIMES),
        "color": rng.choice(COLORS),
        "food": rng.choice(FOODS),
    }
    return rng.choice(templates).format(**slots)


def story(rng: random.Random, name: str, animal: str) -> str:
    """A four-sentence story with a beginning, a middle and an end."""
    place, obj, food = rng.choice(PLACES), rng.choice(OBJECTS), rng.choice(FOODS)
    past = rng.choice(ACTIONS)[1]
    adj = rng.choice(ADJECTIVES)
    lines = (
        f"One {rng.choice(TIMES)}, {name} went to the {place}, and {rng.choice(WEATHER)}.",
        f"There {name} met a {adj} {animal} that had lost its {obj}.",
        f"Together they looked everywhere, and at last {name} {past} the {obj} under a tree.",
        f"The {animal} was so happy that it shared its {food} with {name}.",
    )
    return " ".join(lines)


def paragraph(rng: random.Random, names: tuple[str, ...], num_sentences: int) -> str:
    return " ".join(sentence(rng, names) for _ in range(num_sentences))


def document(rng: random.Random, names: tuple[str, ...]) -> str:
    """A short plain-text document: a story, a paragraph, a list of facts or a diary entry."""
    kind = rng.randrange(4)
    if kind == 0:
        return story(rng, rng.choice(names), rng.choice(ANIMALS))
    if kind == 1:
        return paragraph(rng, names, rng.randint(3, 7))
    if kind == 2:
        return " ".join(rng.sample(FACTS, rng.randint(3, 6)))
    name, place = rng.choice(names), rng.choice(PLACES)
    day = paragraph(rng, names, rng.randint(2, 4))
    return f"Dear diary, today was a good day. {day} Tomorrow {name} will go to the {place}."


# ---------------------------------------------------------------- numbers said in words


_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((1_000_000_000, "billion"), (1_000_000, "million"), (1000, "thousand"))
_IRREGULAR_ORDINALS = {
    "one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
    "nine": "ninth", "twelve": "twelfth",
}  # fmt: skip


def number_words(value: int, conjunction: str = " and ", hyphen: str = "-") -> str:
    """English words for an integer: 105 -> 'one hundred and five', -7 -> 'minus seven'.
    `conjunction` joins hundreds to the rest (" " for the American 'one hundred five') and
    `hyphen` joins tens to ones ('twenty-one', or 'twenty one' with " ")."""
    if value < 0:
        return "minus " + number_words(-value, conjunction, hyphen)
    for scale, name in _SCALES:
        if value >= scale:
            head, rest = divmod(value, scale)
            words = f"{number_words(head, conjunction, hyphen)} {name}"
            if rest:
                words += (conjunction if rest < 100 else " ") + number_words(
                    rest, conjunction, hyphen
                )
            return words
    if value >= 100:
        head, rest = divmod(value, 100)
        words = f"{_ONES[head]} hundred"
        return words + (conjunction + number_words(rest, conjunction, hyphen) if rest else "")
    if value >= 20:
        tens, ones = divmod(value, 10)
        return _TENS[tens] + (hyphen + _ONES[ones] if ones else "")
    return _ONES[value]


def ordinal_words(value: int) -> str:
    """'first', 'twelfth', 'twenty-third', 'thirtieth'."""
    words = number_words(value)
    head, _, last = words.rpartition("-")
    if last in _IRREGULAR_ORDINALS:
        last = _IRREGULAR_ORDINALS[last]
    else:
        last = last[:-1] + "ieth" if last.endswith("y") else last + "th"
    return f"{head}-{last}" if head else last


def ordinal_suffix(value: int) -> str:
    """'st', 'nd', 'rd' or 'th' for a day of the month."""
    if 11 <= value % 100 <= 13:
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(value % 10, "th")


def year_words(year: int) -> str:
    """A year as said aloud: 1984 'nineteen eighty-four', 1905 'nineteen oh five', 2005 'two
    thousand five', 2024 'twenty twenty-four', 1900 'nineteen hundred'."""
    head, rest = divmod(year, 100)
    if 2000 <= year < 2010:
        return f"two thousand {_ONES[rest]}" if rest else "two thousand"
    if rest == 0:
        return f"{number_words(head)} hundred"
    return f"{number_words(head)} {'oh ' + _ONES[rest] if rest < 10 else number_words(rest)}"
