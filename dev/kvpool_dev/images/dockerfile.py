"""The Dockerfile as data: global ARG defaults, named stages with their instructions, and the
`docker build --target X -t TAG .` lines of its header (the image each target is published as).

Pure functions over the text; shared by the image build (kvpool_dev.images.build) and the
static checks (tests/operator/test_images.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

TAG_LINE = re.compile(r"docker build --target ([\w-]+)\s+-t (\S+) \.")


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def args(self) -> dict[str, str]:
        """The stage's ARG defaults (an ARG without a default maps to "")."""
        return {k.strip(): v.strip() for k, _, v in (a.partition("=") for a in self.all("ARG"))}


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name (continuation lines joined, comments dropped)."""
    lines, buf = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.IGNORECASE)
            if m is None:
                raise ValueError(f"every stage must be named (FROM image AS name): {line}")
            base = re.sub(r"\$\{(\w+)\}", lambda g: args[g.group(1)], m.group(1))
            current = stages[m.group(2)] = Stage(base=base, name=m.group(2))
        elif current is None:
            if op == "ARG":
                key, _, default = rest.partition("=")
                args[key.strip()] = default.strip()
        else:
            current.instructions.append((op, rest.strip()))
    return args, stages


def documented_tags(text: str) -> dict[str, str]:
    """target -> image reference, from the header's `docker build --target X -t TAG .` lines."""
    return dict(TAG_LINE.findall(text))


def load(path: Path) -> tuple[str, dict[str, str], dict[str, Stage]]:
    text = path.read_text()
    args, stages = parse_dockerfile(text)
    return text, args, stages
