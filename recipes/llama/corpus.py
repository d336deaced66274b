"""The embedded default dataset: short children's stories generated from a fixed seed.

The demo must train with no download, so the corpus ships as this generator rather than as a
file: the same bytes on every machine (``random.Random`` with a fixed seed is stable across
Python versions), about 0.8 MB of plain English, written by this project and public domain.
It has structure at every scale a small model can learn in minutes: spelling and frequent
words first, then sentence templates, then consistency across a story (the hero's name and
pronoun, the object that was lost and found, the number that was counted).
"""

from __future__ import annotations

import random

__all__ = ["DEFAULT_STORIES", "generate", "stories"]

DEFAULT_STORIES = 1000

HEROES = [
    ("Lily", "she", "her"),
    ("Tom", "he", "his"),
    ("Mia", "she", "her"),
    ("Ben", "he", "his"),
    ("Sara", "she", "her"),
    ("Max", "he", "his"),
    ("Anna", "she", "her"),
    ("Leo", "he", "his"),
    ("Rosa", "she", "her"),
    ("Sam", "he", "his"),
    ("Ella", "she", "her"),
    ("Finn", "he", "his"),
    ("Nora", "she", "her"),
    ("Jack", "he", "his"),
    ("Ivy", "she", "her"),
    ("Omar", "he", "his"),
]
KINDS = ["child", "rabbit", "fox", "bear", "mouse", "duck", "cat", "dog", "owl", "frog"]
TRAITS = ["little", "brave", "curious", "kind", "shy", "happy", "clever", "sleepy", "busy"]
HOMES = [
    "a small house by the river",
    "a warm burrow under an old oak",
    "a blue house on a hill",
    "a cottage at the edge of the forest",
    "a busy town near the sea",
    "a quiet farm",
    "a tall tree in the park",
    "a little village in the valley",
]
PLACES = [
    "the forest",
    "the garden",
    "the beach",
    "the market",
    "the meadow",
    "the pond",
    "the old bridge",
    "the library",
    "the bakery",
    "the playground",
    "the hill",
    "the barn",
]
THINGS = [
    ("red ball", "round and shiny"),
    ("blue kite", "light as a feather"),
    ("golden key", "small and bright"),
    ("wooden boat", "painted green"),
    ("yellow hat", "soft and warm"),
    ("silver bell", "loud and clear"),
    ("picture book", "full of stars"),
    ("glass jar", "clean and empty"),
    ("green scarf", "long and striped"),
    ("paper map", "old and folded"),
]
FRIENDS = [
    ("a wise old owl", "the owl"),
    ("a tiny ant", "the ant"),
    ("a friendly dog", "the dog"),
    ("a kind farmer", "the farmer"),
    ("a busy bee", "the bee"),
    ("a little bird", "the bird"),
    ("a gentle cow", "the cow"),
    ("a funny goat", "the goat"),
    ("an old turtle", "the turtle"),
]
LIKES = [
    "to sing songs",
    "to draw pictures",
    "to read books",
    "to play in the sun",
    "to look at the clouds",
    "to bake bread",
    "to build towers of sand",
    "to count the stars",
    "to splash in puddles",
    "to pick flowers",
]
FEELINGS = [("sad", "happy"), ("worried", "glad"), ("scared", "calm"), ("lonely", "cheerful")]
WEATHER = [
    "The sun was shining.",
    "It was a windy day.",
    "Soft rain was falling.",
    "The sky was grey and cold.",
    "It was a warm spring morning.",
    "Snow covered the ground.",
]
FOODS = ["apples", "cookies", "berries", "carrots", "plums", "nuts", "pears", "cherries"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
HIDING = [
    "under a pile of leaves",
    "behind a big rock",
    "in the tall grass",
    "next to the door",
    "on top of a fence",
    "inside an old boot",
]
SEARCHES = [
    "they looked behind every tree",
    "they asked everyone they met",
    "they looked under the bench",
    "they called its name",
    "they climbed up to look far away",
]
LESSONS = [
    "Friends make hard things easy.",
    "It is good to ask for help.",
    "Sharing makes us happy.",
    "Being patient pays off.",
    "Kindness always comes back.",
    "Never give up.",
    "Look carefully and you will find what you need.",
]


def _story(rng: random.Random) -> str:
    name, he, his = rng.choice(HEROES)
    he_cap = he.capitalize()
    kind, trait, home = rng.choice(KINDS), rng.choice(TRAITS), rng.choice(HOMES)
    thing, looks = rng.choice(THINGS)
    place, other_place = rng.sample(PLACES, 2)
    friend, the_friend = rng.choice(FRIENDS)
    down, up = rng.choice(FEELINGS)
    food, count = rng.choice(FOODS), rng.randrange(2, 11)
    lines = [
        rng.choice(["Once upon a time,", "One day,", "Long ago,", "Not so long ago,"])
        + f" there was a {trait} {kind} named {name}.",
        f"{name} lived in {home}.",
        f"{he_cap} liked {rng.choice(LIKES)}, and {he} had a {thing} that was {looks}.",
        rng.choice(WEATHER),
        f"{name} took the {thing} to {place}.",
        f"But when {he} looked again, the {thing} was gone!",
        f"{name} felt {down}. "
        + rng.choice([f'"Where is my {thing}?" {he} asked.', f'"I lost my {thing}," {he} said.']),
        f"Then {name} met {friend}. "
        + rng.choice(
            [
                f'"I will help you," said {the_friend}.',
                f'"Let us look together," said {the_friend}.',
            ]
        ),
        f"They looked near {other_place}, and {rng.choice(SEARCHES)}.",
        f"At last, {the_friend} found the {thing} {rng.choice(HIDING)}.",
        f"{name} was {up} again. " + f'"Thank you!" {he} said.',
        f"To say thank you, {name} shared {his} {food} with {the_friend}.",
        f"{he_cap} counted them: " + ", ".join(NUMBERS[:count]) + ". "
        f"There were {NUMBERS[count - 1]} {food}.",
        f"From that day on, {name} and {the_friend} were good friends.",
        rng.choice(LESSONS),
    ]
    return " ".join(lines)


def stories(count: int = DEFAULT_STORIES, seed: int = 0) -> list[str]:
    """``count`` stories, each one document of the default dataset; the same for the same
    arguments."""
    rng = random.Random(seed)
    return [_story(rng) for _ in range(count)]


def generate(count: int = DEFAULT_STORIES, seed: int = 0) -> str:
    """The stories as one text, separated by blank lines (the form the tests pin by sha256)."""
    return "\n\n".join(stories(count, seed)) + "\n"
