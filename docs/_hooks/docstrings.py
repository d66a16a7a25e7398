"""MkDocs hook: render mixprec's reStructuredText-flavoured docstrings as Markdown.

The docstrings are written for ``help()`` and doctest: free-standing ``>>>``
examples and Sphinx roles (``:class:`Plan```). Markdown would turn ``>>>`` into
nested block quotes and read ``[a, b]`` outputs as links, so this hook adds a
Markdown preprocessor (mkdocstrings renders docstrings with the site's Markdown
extensions, so it sees them too) that:

- wraps each doctest block (from a ``>>>`` line to the next blank line) in a
  ```` ```pycon ```` fence;
- turns ``:role:`name``` into ``name`` in code style.

Text inside existing fences is left alone.
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|obj|exc|const):`~?([^`]+)`")
_FENCE = re.compile(r"^\s*(```|~~~)")


class _DoctestFences(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        in_fence = False
        in_doctest = False
        indent = ""
        for line in lines:
            if in_doctest:
                if line.strip() == "":
                    out.append(indent + "```")
                    out.append(line)
                    in_doctest = False
                else:
                    out.append(line)
                continue
            if _FENCE.match(line):
                in_fence = not in_fence
                out.append(line)
                continue
            if not in_fence and line.lstrip().startswith(">>>"):
                indent = line[: len(line) - len(line.lstrip())]
                out.append(indent + "```pycon")
                out.append(line)
                in_doctest = True
                continue
            out.append(line if in_fence else _ROLE.sub(r"`\1`", line))
        if in_doctest:
            out.append(indent + "```")
        return out


class _DocstringExtension(Extension):
    def extendMarkdown(self, md: Markdown) -> None:
        # Before the fenced-code preprocessors (superfences registers at 25).
        md.preprocessors.register(_DoctestFences(md), "mixprec_doctest_fences", 40)


def on_config(config: Any) -> Any:
    config["markdown_extensions"].append(_DocstringExtension())
    return config
