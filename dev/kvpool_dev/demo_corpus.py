"""What the demo's users chat about: kvpool's own docs (real English prose, offline, in the
repository), cut into one document per conversation, and the questions they ask (pure but
for reading the files)."""

from __future__ import annotations

from pathlib import Path

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"   # what the users chat about
SYSTEM_PROMPT = ("You are a helpful assistant. Answer the user's questions about this "
                 "document in one or two sentences.\n\n")
QUESTIONS = (  # turn k asks QUESTIONS[k % len]
    "What is this document about?",
    "Which part of the system does it describe, and what does that part do?",
    "What does an operator have to configure, according to the document?",
    "What is one limitation or risk the document mentions?",
    "Who would read this document, and why?",
    "Summarise the document's main point in one sentence.",
)


def prose_paragraphs(markdown: str) -> list[str]:
    """The prose of a Markdown file, one string per paragraph: headings, code blocks and
    tables left out (a chat about a document reads its sentences), lines of a paragraph
    joined (pure)."""
    paragraphs: list[str] = []
    lines: list[str] = []
    fenced = False

    def flush() -> None:
        if lines:
            paragraphs.append(" ".join(lines))
            lines.clear()

    for raw in markdown.splitlines():
        line = raw.strip()
        if line.startswith("```"):
            fenced = not fenced
            flush()
        elif fenced or not line or line.startswith(("#", "|")):
            flush()
        else:
            lines.append(line)
    flush()
    return paragraphs


def load_corpus(docs_dir: Path) -> list[str]:
    """Every paragraph of the Markdown files in `docs_dir`, files in name order."""
    if not docs_dir.is_dir():
        raise ValueError("no such directory")
    files = sorted(docs_dir.glob("*.md"))
    paragraphs = [p for f in files for p in prose_paragraphs(f.read_text(encoding="utf-8"))]
    if not paragraphs:
        raise ValueError("no Markdown prose (*.md) to chat about")
    return paragraphs


def _fill(taken: list[str], paragraph: str, n_tokens: int, count_tokens) -> str:
    """The paragraphs taken, then as many leading words of `paragraph` as keep the text at
    most n_tokens long (binary search: a tokenizer counts a whole text, not a word)."""
    words = paragraph.split()
    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens("\n\n".join([*taken, " ".join(words[:mid])])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return "\n\n".join([*taken, " ".join(words[:lo])] if lo else taken)


def documents(paragraphs: list[str], n: int, n_tokens: int, count_tokens) -> list[str]:
    """n documents of n_tokens each (at most; a word less at worst): consecutive paragraphs
    from n starts spread evenly over the corpus (so the users read different files), wrapping
    round its end, the last one cut at a word; distinct starts make every user's document
    their own (pure)."""
    if n > len(paragraphs):
        raise ValueError(f"{len(paragraphs)} paragraphs of prose cannot start {n} documents")
    docs: list[str] = []
    for k in range(n):
        at = k * len(paragraphs) // n
        taken: list[str] = []
        while True:
            if len(taken) == len(paragraphs):
                raise ValueError(f"the corpus is shorter than {n_tokens} tokens")
            nxt = paragraphs[(at + len(taken)) % len(paragraphs)]
            if count_tokens("\n\n".join([*taken, nxt])) > n_tokens:
                docs.append(_fill(taken, nxt, n_tokens, count_tokens))
                break
            taken.append(nxt)
    return docs
