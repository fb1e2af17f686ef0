"""The README's commands, read the way a user copies them."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def top_commands(text: str | None = None) -> list[str]:
    """The commands the README opens with: the indented lines before its first paragraph."""
    lines = (README.read_text() if text is None else text).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    commands = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        commands.append(line.strip())
    return commands


def fenced_block(heading: str, text: str | None = None) -> str:
    """The body of the first ``` block under the line ``heading``."""
    lines = (README.read_text() if text is None else text).splitlines()
    if heading not in lines:
        raise AssertionError(f"README.md has no line {heading!r}")
    rest = lines[lines.index(heading) + 1:]
    opening = next(i for i, line in enumerate(rest) if line.startswith("```"))
    closing = next(i for i, line in enumerate(rest[opening + 1:], opening + 1) if line.startswith("```"))
    return "\n".join(rest[opening + 1:closing]) + "\n"
