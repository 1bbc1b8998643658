"""Deterministic prompt text: words drawn from a fixed list by a seeded generator.

Sizes are aimed in tokens but written in words: `words_for` turns a token
target into a word count with the tokens-per-word ratio the bench measured on
the first target that reports usage (`calibrate` in workloads.py). Each
request's real prompt length comes back in its usage and is what the report
shows.
"""

from __future__ import annotations

import random

#: Common English words: almost all are one token after a space in the SmolLM2/Llama-style
#: vocabularies, so ~1 token per word; the measured ratio corrects for other tokenizers.
# fmt: off
WORDS: tuple[str, ...] = (
    "able", "about", "above", "across", "act", "add", "after", "again", "against", "age", "ago", "agree",
    "air", "all", "allow", "almost", "alone", "along", "already", "also", "always", "among", "amount",
    "animal", "answer", "any", "appear", "apply", "area", "arm", "around", "arrive", "art", "ask", "baby",
    "back", "bad", "bag", "ball", "bank", "base", "basket", "beach", "bear", "beat", "beauty", "become",
    "bed", "before", "begin", "behind", "believe", "bell", "below", "best", "better", "between", "big",
    "bird", "black", "blood", "blue", "board", "boat", "body", "bone", "book", "born", "both", "bottom",
    "box", "boy", "branch", "bread", "break", "bright", "bring", "broad", "brother", "brown", "build",
    "burn", "busy", "buy", "call", "camp", "can", "capital", "captain", "car", "card", "care", "carry",
    "case", "cat", "catch", "cause", "cell", "center", "chair", "chance", "change", "chart", "check",
    "chief", "child", "choose", "church", "circle", "city", "class", "clean", "clear", "climb", "clock",
    "close", "cloud", "coast", "coat", "cold", "collect", "colony", "color", "column", "come", "common",
    "company", "compare", "complete", "condition", "connect", "consider", "contain", "continue", "control",
    "cook", "cool", "copy", "corn", "corner", "correct", "cost", "cotton", "could", "count", "country",
    "course", "cover", "cow", "create", "crop", "cross", "crowd", "cry", "current", "cut", "dance", "dark",
    "day", "dead", "deal", "dear", "death", "decide", "deep", "degree", "depend", "describe", "desert",
    "design", "detail", "develop", "differ", "direct", "discuss", "distant", "divide", "doctor", "dog",
    "door", "double", "down", "draw", "dream", "dress", "drink", "drive", "drop", "dry", "duck", "during",
    "each", "early", "earth", "ease", "east", "eat", "edge", "effect", "egg", "eight", "either", "electric",
    "element", "end", "enemy", "energy", "engine", "enough", "enter", "equal", "even", "event", "ever",
    "every", "exact", "example", "except", "excite", "exercise", "expect", "experience", "eye", "face",
    "fact", "fair", "fall", "family", "famous", "far", "farm", "fast", "father", "favor", "fear", "feed",
    "feel", "few", "field", "fight", "figure", "fill", "final", "find", "fine", "finger", "finish", "fire",
    "first", "fish", "fit", "five", "flat", "floor", "flow", "flower", "fly", "follow", "food", "foot",
    "force", "forest", "form", "forward", "four", "free", "fresh", "friend", "front", "fruit", "full",
    "game", "garden", "gas", "gather", "general", "gentle", "girl", "give", "glad", "glass", "gold", "good",
    "grass", "gray", "great", "green", "ground", "group", "grow", "guess", "guide", "gun", "hair", "half",
    "hand", "happen", "happy", "hard", "hat", "head", "hear", "heart", "heat", "heavy", "help", "here",
    "high", "hill", "history", "hold", "hole", "home", "hope", "horse", "hot", "hour", "house", "huge",
    "human", "hunt", "idea", "inch", "include", "industry", "insect", "instant", "iron", "island", "job",
    "join", "joy", "jump", "just", "keep", "key", "kind", "king", "know", "lady", "lake", "land",
    "language", "large", "last", "late", "laugh", "law", "lay", "lead", "learn", "leave", "left", "leg",
    "length", "letter", "level", "life", "lift", "light", "like", "line", "liquid", "list", "listen",
    "little", "live", "long", "look", "lost", "loud", "love", "low", "machine", "main", "major", "make",
    "man", "many", "map", "mark", "market", "master", "match", "matter", "meant", "measure", "meat", "meet",
    "melody", "member", "metal", "method", "middle", "might", "mile", "milk", "mind", "minute", "miss",
    "modern", "moment", "money", "month", "moon", "morning", "mother", "motion", "mountain", "mouth",
    "move", "music", "name", "nation", "natural", "near", "need", "neighbor", "never", "new", "next",
    "night", "nine", "noise", "noon", "north", "nose", "note", "nothing", "notice", "number", "object",
    "ocean", "offer", "office", "often", "oil", "old", "once", "only", "open", "operate", "order", "organ",
    "other", "out", "oxygen", "page", "paint", "pair", "paper", "paragraph", "parent", "part", "party",
    "pass", "past", "path", "pattern", "pay", "people", "perhaps", "period", "person", "picture", "piece",
    "place", "plain", "plan", "plane", "planet", "plant", "play", "please", "plural", "poem", "point",
    "poor", "position", "possible", "pound", "power", "practice", "prepare", "present", "press", "pretty",
    "print", "probable", "problem", "process", "produce", "product", "proper", "property", "protect",
    "prove", "provide", "pull", "push", "quart", "question", "quick", "quiet", "quite", "race", "radio",
    "rain", "raise", "range", "rather", "reach", "read", "ready", "real", "reason", "receive", "record",
    "region", "remember", "repeat", "reply", "rest", "result", "rich", "ride", "right", "ring", "rise",
    "river", "road", "rock", "roll", "room", "root", "rope", "rose", "round", "row", "rule", "run", "safe",
    "sail", "salt", "same", "sand", "save", "say", "school", "science", "score", "sea", "season", "seat",
    "second", "section", "see", "seed", "seem", "select", "sell", "send", "sense", "sentence", "separate",
    "serve", "settle", "seven", "several", "shape", "share", "sharp", "sheet", "shell", "shine", "ship",
    "shoe", "shop", "shore", "short", "shoulder", "shout", "show", "side", "sight", "sign", "silent",
    "silver", "simple", "since", "sing", "single", "sister", "sit", "six", "size", "skill", "skin", "sky",
    "sleep", "slow", "small", "smell", "smile", "snow", "soft", "soil", "soldier", "solution", "solve",
    "song", "soon", "sound", "south", "space", "speak", "special", "speed", "spell", "spend", "spoke",
    "spot", "spread", "spring", "square", "stand", "star", "start", "state", "station", "stay", "steam",
    "steel", "step", "stick", "still", "stone", "stood", "stop", "store", "story", "straight", "strange",
    "stream", "street", "stretch", "string", "strong", "student", "study", "subject", "sudden", "sugar",
    "summer", "sun", "supply", "support", "sure", "surface", "surprise", "swim", "syllable", "symbol",
    "system", "table", "tail", "take", "talk", "teach", "team", "teeth", "tell", "temperature", "ten",
    "term", "test", "thank", "thick", "thin", "thing", "third", "thought", "thousand", "three", "through",
    "throw", "tie", "time", "tiny", "tire", "together", "tone", "tool", "top", "total", "touch", "toward",
    "town", "track", "trade", "train", "travel", "tree", "triangle", "trip", "trouble", "truck", "true",
    "try", "tube", "turn", "twenty", "type", "under", "unit", "until", "upon", "usual", "valley", "value",
    "vary", "verb", "very", "view", "village", "visit", "voice", "vowel", "wait", "walk", "wall", "want",
    "warm", "wash", "watch", "water", "wave", "wear", "weather", "week", "weight", "well", "west", "wheel",
    "white", "whole", "wide", "wife", "wild", "will", "win", "wind", "window", "wing", "winter", "wire",
    "wish", "woman", "wonder", "wood", "word", "work", "world", "write", "yard", "year", "yellow", "young",
)
# fmt: on


def words_for(tokens: int, tokens_per_word: float) -> int:
    """Words to write for a prompt of about `tokens` tokens."""
    assert tokens_per_word > 0, f"tokens_per_word must be positive (calibration returned {tokens_per_word})"
    return max(1, round(tokens / tokens_per_word))


def passage(seed: int | str, n_words: int, *, first: str | None = None) -> str:
    """`n_words` words from a generator seeded with `seed` (the same seed gives the same text).

    `first`: the opening word, for prompts that must differ from their first token on (the zero
    workload); sentences of 8-15 words keep the text prose-like for tokenizers that merge runs.
    """
    rng = random.Random(f"skippy-bench:{seed}")
    out: list[str] = [first] if first else []
    while len(out) < n_words:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(8, 15))]
        out.extend(sentence[:-1] + [sentence[-1] + "."])
    text = " ".join(out[:n_words])
    return text[0].upper() + text[1:]
