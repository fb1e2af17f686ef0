"""A chat answer's reasoning, split from its content (Qwen3's and DeepSeek-R1's ``<think>`` blocks).

Where the reasoning starts is read from the prompt the chat template wrote, not guessed from
the output: a prompt that ends inside an open ``<think>`` block (a template that opens it for
the model) makes the answer reasoning up to ``</think>``; otherwise an answer that opens with
``<think>`` reasons up to ``</think>``, and any other answer is all content (Qwen3 with
``enable_thinking: false``, whose template writes an empty block into the prompt). A model
whose template has no ``</think>`` is never split.

The reasoning goes to the message's ``reasoning_content`` (as vLLM's reasoning parsers put
it), the rest to ``content``, whole or streamed delta by delta. A constrained answer (a
grammar, a required tool call) to a prompt that opens the block gets the block closed empty
in its prompt: the grammar binds from the first token, which must be the answer's.
"""

from __future__ import annotations

from deployments.tool_calls import held_tail

START, END = "<think>", "</think>"
OPEN, TAGGED = "open", "tagged"  # the answer starts as reasoning / reasons if it opens with START


def closed_think_block(prompt_text: str) -> str:
    """A prompt that ends in an open block, with the block closed empty (Qwen3's form with
    thinking off): the answer starts after it."""
    return prompt_text[:prompt_text.rfind(START)] + f"{START}\n\n{END}\n\n"


def reasoning_mode(chat_template: str | None, prompt_text: str) -> str | None:
    """How an answer to `prompt_text` splits: OPEN, TAGGED, or None (never)."""
    if END not in (chat_template or ""):
        return None
    return OPEN if prompt_text.rfind(START) > prompt_text.rfind(END) else TAGGED


class ReasoningSplitter:
    """Feeds an answer's text in pieces; each feed returns the (reasoning, content) text
    that is certain so far. Text that may still become a marker is held back, and so are the
    newlines that open and close the reasoning (a whole answer fed at once splits the same)."""

    def __init__(self, mode: str):
        self._state = "reasoning" if mode == OPEN else "start"
        self._fresh = True  # no reasoning text out yet: its leading newlines are dropped
        self._held = ""

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        held, self._held = self._held + text, ""
        reasoning = ""
        if self._state == "start":
            stripped = held.lstrip()
            if stripped.startswith(START):
                held, self._state = stripped[len(START):], "reasoning"
            elif START.startswith(stripped) and not finished:
                self._held = held  # may still open with START
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = held.find(END)
            if at >= 0:
                reasoning, held, self._state = held[:at].rstrip("\n"), held[at + len(END):], "after"
            else:
                keep = 0 if finished else held_tail(held, END)
                reasoning, self._held = held[:len(held) - keep], held[len(held) - keep:]
                if not finished:  # newlines that may end the block wait for what follows them
                    newlines = len(reasoning) - len(reasoning.rstrip("\n"))
                    reasoning, self._held = reasoning[:len(reasoning) - newlines], \
                        reasoning[len(reasoning) - newlines:] + self._held
            if self._fresh:
                reasoning = reasoning.lstrip("\n")
                self._fresh = not reasoning
            if self._state == "reasoning":
                return reasoning, ""
        if self._state == "after":  # the blank lines between the block and the answer
            held = held.lstrip("\n")
            if not held:
                return reasoning, ""
            self._state = "content"
        return reasoning, held


def split_reasoning(mode: str | None, text: str) -> tuple[str | None, str]:
    """A whole answer's (reasoning, content); reasoning None where the answer has none."""
    if mode is None:
        return None, text
    opened = mode == OPEN or text.lstrip().startswith(START)
    reasoning, content = ReasoningSplitter(mode).feed(text, finished=True)
    return (reasoning if opened else None), content


__all__ = ["OPEN", "TAGGED", "ReasoningSplitter", "closed_think_block", "reasoning_mode", "split_reasoning"]
