"""A real generator's side of the citation signal: the prompt that asks for an answer and
its citations in one call (:data:`RMM_PROMPT_TEMPLATE`, :func:`format_prompt`), and the
parser that turns the reply's inline citations (``[1, 3]``, ``[Memory 2]``, ``[M1][M3]``,
``[NO_CITE]``) into 0-based positions among the shown memories (:func:`parse_citations`).

Simulated citations, for runs without an LLM, are :mod:`rmm_jax.data.citations`.
"""
from __future__ import annotations

import numbers
import re
from typing import Sequence

from rmm_jax.errors import InputError

__all__ = ["NO_CITE", "RMM_PROMPT_TEMPLATE", "format_prompt", "parse_citations"]

#: The token a generator emits when no memory was useful.
NO_CITE = "[NO_CITE]"

_GROUP = re.compile(r"\[([^\[\]]*)\]")
_ITEM = re.compile(r"\s*(?:memory\s*|m\s*)?([0-9]+)\s*", re.IGNORECASE | re.ASCII)
_NO_CITE = re.compile(r"\s*no[_ ]?cite\s*", re.IGNORECASE)
_SEP = re.compile(r"[,;]")


def parse_citations(text: str, num_shown: int) -> tuple[int, ...]:
    """0-based positions of the memories cited in ``text``, first appearance first.

    A citation is a bracket group whose comma- (or semicolon-) separated items are all
    citation tokens: ``N``, ``Memory N``, ``MemoryN``, ``M N`` or ``MN`` (case-insensitive,
    ``N`` 1-based). Accepted examples: ``[1]``, ``[2, 3]``, ``[1,2]``, ``[Memory 3]``,
    ``[memory 3]``, ``[M2]``, ``[m2]``, ``[Memory 1, Memory 4]``, ``[M1][M3]``. A group
    with any other item (``[see above]``, ``[1, foo]``) is not a citation and is ignored
    whole. ``[NO_CITE]`` contributes nothing, so a reply citing nothing returns ``()``.

    Numbers outside ``1..num_shown`` are ignored (so years such as ``[2023]`` do not
    count); repeated citations are kept once, at their first position.
    """
    if not isinstance(text, str):
        raise InputError(f"must be a str, got {type(text).__name__}", where="argument 'text'")
    if isinstance(num_shown, bool) or not isinstance(num_shown, numbers.Integral) or num_shown < 0:
        raise InputError(f"must be a non-negative int, got {num_shown!r}",
                         where="argument 'num_shown'")
    num_shown = int(num_shown)
    seen: dict[int, None] = {}
    for group in _GROUP.finditer(text):
        body = group.group(1)
        if _NO_CITE.fullmatch(body):
            continue
        numbers_in_group = []
        for item in _SEP.split(body):
            m = _ITEM.fullmatch(item)
            if m is None:
                numbers_in_group = None
                break
            numbers_in_group.append(int(m.group(1)))
        if not numbers_in_group:
            continue
        for n in numbers_in_group:
            if 1 <= n <= num_shown:
                seen.setdefault(n - 1, None)
    return tuple(seen)


RMM_PROMPT_TEMPLATE = """\
You are a helpful assistant with a long-term memory of your past conversations with \
this user. Below are memories retrieved for the user's current message, each numbered.

{memories}

User: {query}

Instructions:
1. Answer the user's message. Use the memories only where they are relevant; if none \
is, answer from the conversation alone.
2. After your answer, on a final line of its own, cite the memories you actually used \
by their numbers, e.g. "Citations: [1, 3]". Cite only memories that contributed to the \
answer. If no memory was useful, write "Citations: [NO_CITE]".

Response:"""
"""Prompt for RMM's one-call "answer, then cite" generator.

Placeholders: ``{memories}`` - the selected memories, one per line, numbered from 1 in
the order the reranker chose (``Memory [1]: ...``); ``{query}`` - the user's message.
The reply ends with a line ``Citations: [i, j]`` or ``Citations: [NO_CITE]``, which
:func:`parse_citations` turns into 0-based positions among the shown memories. Fill it
with :func:`format_prompt`.
"""


def format_prompt(query: str, memories: Sequence[str]) -> str:
    """Fill :data:`RMM_PROMPT_TEMPLATE`: memories numbered ``Memory [1]: ...`` in order.

    With no memories the block reads ``(no memories)`` and the generator is expected
    to answer ``[NO_CITE]``.
    """
    if not isinstance(query, str):
        raise InputError(f"must be a str, got {type(query).__name__}", where="argument 'query'")
    if isinstance(memories, str) or not isinstance(memories, Sequence):
        raise InputError(f"must be a list of str, got {type(memories).__name__}",
                         where="argument 'memories'")
    for i, mem in enumerate(memories):
        if not isinstance(mem, str):
            raise InputError(f"item {i} is {type(mem).__name__}, expected str",
                             where="argument 'memories'")
    block = "\n".join(f"Memory [{i}]: {mem}" for i, mem in enumerate(memories, start=1))
    return RMM_PROMPT_TEMPLATE.format(memories=block or "(no memories)", query=query)
