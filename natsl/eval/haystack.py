"""Local material for the RULER needle tasks: key words and an essay-like haystack.

RULER draws its keys as adjective-noun pairs and its essay haystack from Paul Graham's essays.
Nothing is downloaded here: keys come from the word lists below and the essay haystack from a
seeded grammar that writes plain English prose about work, software, startups and writing. The
same seed always gives the same text (Python's `random.Random` is stable across versions for the
calls used). `--essay-file` in `natsl eval-ruler` swaps in real essays when you have them.
"""

from __future__ import annotations

import random
import re

ADJECTIVES = """
able absent acid ancient angry autumn awful bitter black blazing bold brave bright brisk broad
calm careful cheap chilly clever cloudy cold cosmic crisp curly damp dark deep dizzy dry dusty
eager early elegant empty faint fancy fast fierce flat fluffy foggy fresh frozen gentle giant
glad golden grand green grumpy handsome happy hard heavy hidden hollow honest huge humble icy
jolly kind large late lazy light little lively lonely loud lucky mellow merry mighty misty modern
narrow neat nervous noisy odd old orange pale patient plain polite proud purple quick quiet rapid
rare red rich rough round royal rusty sandy scarlet shiny short shy silent silver simple sleepy
slow small smooth soft solid sour spicy steady steep sticky stormy strange strong sunny sweet
swift tall tame tender thick thin tidy tiny tough true twin vast violet warm wet wild windy wise
wooden yellow young zany
""".split()

NOUNS = """
acorn anchor apple arch arrow badge bakery ball banjo barn basket beacon bean bell bench berry
bicycle bird blanket boat bottle boulder branch bridge brook brush bucket button cabin cactus
camera candle canoe canyon carpet castle cat cellar chair cherry chimney circle cliff clock cloud
coast comet compass cookie copper cottage crane crayon crown cup curtain daisy desert diamond
dolphin door dragon drum eagle engine falcon feather fence fern fiddle field flame flute forest
fountain fox garden gate glacier globe goose guitar hammer harbor hat hill horizon horse island
jacket jar kettle kite ladder lake lamp lantern leaf lemon lighthouse lily lion map maple meadow
mirror mitten moon mountain needle nest oak ocean orchard otter owl paddle palace pebble pencil
pepper piano pillow pine planet pond quilt rabbit raft river robin rocket saddle sail shell
shovel spoon squirrel star stone stream sun tiger torch tower train tulip tunnel turtle valley
violin wagon walnut whale willow window wolf
""".split()

KEY_WORDS = sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS})

# ---------------------------------------------------------------------------------------------
# An essay-like prose generator. Sentences are built from templates whose slots draw on small
# vocabularies, so the text reads as ordinary (if meandering) English and tokenizes like it.

_PLURAL_SUBJECTS = [
    "most founders", "the best essays", "young companies", "people who build things", "good writers",
    "most schools", "the people around you", "large organizations", "many hackers", "experienced engineers",
    "the users", "most investors",
]
_SINGULAR_SUBJECTS = [
    "a good programmer", "a small team", "the typical investor", "a new language", "the first version",
    "a curious student", "the market", "an ambitious project", "a careful reader", "every startup",
]
_SUBJECTS = _PLURAL_SUBJECTS + _SINGULAR_SUBJECTS
_VERBS = [
    "underestimate", "discover", "ignore", "learn", "notice", "rewrite", "argue about", "depend on",
    "work around", "explain", "care about", "waste time on", "get better at", "return to", "question",
]
_OBJECTS = [
    "the problems they are actually solving", "what users want", "the cost of moving slowly",
    "the details that matter", "ideas that seem obvious later", "the shape of the work",
    "how much they do not know", "the simplest version of the idea", "their own assumptions",
    "the difference between talk and work", "what makes a thing good", "the time it takes to finish",
    "the habits that made them successful", "unfashionable questions", "the code they wrote last year",
]
_ADVERBS = ["usually", "often", "rarely", "gradually", "almost always", "sometimes", "eventually", "quietly"]
_OPENERS = [
    "In practice,", "Surprisingly,", "For a long time,", "As far as I can tell,", "In the beginning,",
    "Looking back,", "Most of the time,", "Over the years,", "At first,", "In my experience,",
]
_CLAUSES = [
    "because it is easier than thinking", "even when nobody is watching", "which is why it works",
    "and that turns out to matter", "though few of them admit it", "long before anyone else does",
    "when the stakes are low", "once the novelty wears off", "if they are honest about it",
    "in the same way a painter learns to see",
]
_ABSTRACTS = [
    "Taste", "Ambition", "Curiosity", "Patience", "Good work", "Writing", "Hard work", "Independence",
    "Focus", "Originality", "Persistence", "Simplicity",
]
_PREDICATES = [
    "is mostly a matter of paying attention", "comes from doing the work many times",
    "is harder to fake than people think", "looks obvious only in hindsight",
    "grows when you stop worrying about what others think", "is easier to learn than to teach",
    "depends more on time than on talent", "is what separates the good from the great",
]


def _third_person(verb: str) -> str:
    """'argue about' -> 'argues about', 'rewrite' -> 'rewrites', 'worry' -> 'worries'."""
    head, _, rest = verb.partition(" ")
    if head.endswith(("s", "sh", "ch", "x")):
        head += "es"
    elif head.endswith("y") and head[-2:-1] not in "aeiou":
        head = head[:-1] + "ies"
    else:
        head += "s"
    return f"{head} {rest}".strip()


def _agree(subject: str, verb: str) -> str:
    return verb if subject in _PLURAL_SUBJECTS else _third_person(verb)


def _clause(rng: random.Random, adverb: bool = False) -> str:
    """subject + (adverb) + agreeing verb + object."""
    subject = rng.choice(_SUBJECTS)
    middle = f"{rng.choice(_ADVERBS)} " if adverb else ""
    return f"{subject} {middle}{_agree(subject, rng.choice(_VERBS))} {rng.choice(_OBJECTS)}"


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        s = f"{rng.choice(_OPENERS)} {_clause(rng, adverb=True)}."
    elif kind == 1:
        s = f"{_clause(rng)}, {rng.choice(_CLAUSES)}."
    elif kind == 2:
        s = f"{rng.choice(_ABSTRACTS)} {rng.choice(_PREDICATES)}."
    elif kind == 3:
        s = f"If {_clause(rng)}, {rng.choice(_SUBJECTS)} will {rng.choice(_VERBS)} it too."
    elif kind == 4:
        s = f"The reason {_clause(rng)} is that {rng.choice(_ABSTRACTS).lower()} {rng.choice(_PREDICATES)}."
    else:
        s = f"{rng.choice(_OPENERS)} {rng.choice(_ABSTRACTS).lower()} {rng.choice(_PREDICATES)}, {rng.choice(_CLAUSES)}."
    return s[0].upper() + s[1:]


class EssaySentences:
    """An endless, deterministic list of essay-like sentences: `sentences[:n]` is stable in `n`."""

    def __init__(self, seed: int = 0, sentences: list[str] | None = None):
        self._rng = random.Random(f"natsl-essay/{seed}")
        self._fixed = sentences is not None
        self._items: list[str] = list(sentences or [])

    def take(self, n: int) -> list[str]:
        if self._fixed:
            return self._items[:n]
        while len(self._items) < n:
            self._items.append(_sentence(self._rng))
        return self._items[:n]

    def available(self) -> int | None:
        """How many sentences there are (None: unlimited)."""
        return len(self._items) if self._fixed else None


def split_sentences(text: str) -> list[str]:
    """A plain splitter for `--essay-file` text: whitespace collapsed, split after . ! ? followed by a space."""
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def essay_text(num_sentences: int, seed: int = 0) -> str:
    """A block of generated essay prose (also handy as a tiny training text)."""
    return " ".join(EssaySentences(seed).take(num_sentences))
