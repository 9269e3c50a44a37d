"""How the vote's samples differ from the caller's request, besides temperature and seed
(``MoaConfig.vote_style``, issue 43 item 3; ``bench/moa_heldout.py`` measures each style).

- ``framings``: greedy samples, each under another framing of the task (a system line): the
  diversity of a differently worded prompt rather than of sampling noise.
- ``reasoning``: every sample reasons in a few sentences before a final ``Answer:`` line
  (self-consistency over reasoning paths, Wang et al. 2022); the vote reads that line.
"""

from __future__ import annotations

from gateway.request import ChatRequest, Message

FRAMINGS = (
    "Read the question carefully, then answer it exactly.",
    "You are an expert at puzzles and arithmetic.",
    "Be precise: a single mistake makes the answer wrong.",
    "You are a careful teacher checking a student's exercise.",
    "Answer the way an exam's answer key would.",
    "Pay attention to every number and word in the question.",
    "You solve problems step by step in your head and answer concisely.",
)
REASONING = (
    "Before answering, think it through step by step in a few short sentences. Then write the "
    "final answer alone on the last line, as: Answer: <answer>"
)
REASONING_MAX_TOKENS = 192  # room for the reasoning: a cut-off sample votes with less


def framed(sample: ChatRequest, index: int) -> ChatRequest:
    """Sample ``index`` (1…) greedy, under the framing its index picks, ahead of any system
    prompt of the caller's."""
    framing = FRAMINGS[(index - 1) % len(FRAMINGS)]
    messages = list(sample.messages)
    if messages and messages[0].role == "system":
        head = messages.pop(0)
        framing = f"{framing}\n\n{head.content}"
    messages.insert(0, Message(role="system", content=framing))
    return sample.model_copy(update={"messages": messages, "temperature": 0.0})


def reasoned(sample: ChatRequest) -> ChatRequest:
    """The sample asked to reason before its final answer, with room to."""
    messages = list(sample.messages)
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            content = f"{messages[i].content}\n\n{REASONING}"
            messages[i] = messages[i].model_copy(update={"content": content})
            break
    budget = max(sample.max_tokens or 0, REASONING_MAX_TOKENS)
    return sample.model_copy(update={"messages": messages, "max_tokens": budget})
