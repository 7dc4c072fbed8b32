"""The fenced code blocks of the project's Markdown pages, as the tests read them
(test_docs runs them; test_testing takes docs/testing.md's example files from them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = ("python", "sql")
NOT_RUNNABLE = ("sh", "ini", "text")
PRINTS = "It prints:"  # a paragraph between a python block and the text it prints


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    language: str
    code: str
    line: int  # 1-based line of the block's first code line in the file
    number: int = 0  # 1-based among the runnable blocks of its file (0: not runnable)
    prints: str | None = None  # what a python block must print, when the page says so

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @property
    def test_id(self) -> str:
        return f"{self.name}-block{self.number}-{self.language}"


def extract(path: Path, text: str | None = None) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown file, and a list of problems (indented code
    blocks, fences without a language, unknown languages).

    A python block followed by a paragraph "It prints:" and a ``text`` block
    must print exactly that text.
    """
    if text is None:
        text = path.read_text("utf-8")
    blocks: list[Block] = []
    problems: list[str] = []
    number = 0
    tokens = MarkdownIt("commonmark").parse(text)
    for index, token in enumerate(tokens):
        if (token.type == "fence" and token.info.strip() == "text" and blocks
                and blocks[-1].language == "python" and index >= 4
                and tokens[index - 2].content.strip() == PRINTS
                and tokens[index - 4].type == "fence" and tokens[index - 4].info == "python"):
            blocks[-1] = dataclasses.replace(blocks[-1], prints=token.content)
        if token.map is None:
            continue
        where = f"{path.name}:{token.map[0] + 1}"
        if token.type == "code_block":
            problems.append(f"{where}: indented code block; use a fence with a language")
            continue
        if token.type != "fence":
            continue
        language = token.info.split()[0] if token.info.strip() else ""
        if language not in RUNNABLE + NOT_RUNNABLE:
            problems.append(f"{where}: fence language {language!r} is none of "
                            f"{RUNNABLE + NOT_RUNNABLE}")
            continue
        runnable = language in RUNNABLE
        number += runnable
        blocks.append(Block(path, language, token.content, token.map[0] + 2,
                            number if runnable else 0))
    return blocks, problems
