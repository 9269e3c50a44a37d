"""Pieces every API parser shares: where system messages go."""

from __future__ import annotations

from gateway.request import Message


def place_system_messages(messages: list[Message]) -> list[Message]:
    """Keep leading system messages; fold a later one into the nearest tool result or user turn.

    Agent harnesses inject system reminders mid-conversation. Hoisting them into the leading
    system prompt would rewrite the prefix every turn (killing the prompt cache) and move the
    reminder away from the moment it refers to; chat templates often reject a system turn
    elsewhere. So it is appended to the user/tool message right before it, else prepended to the
    next user/tool message (never moved across an assistant turn), else it becomes a user turn.
    """
    out: list[Message] = []
    leading = True
    pending: list[str] = []
    for message in messages:
        if message.role == "system":
            if leading:
                out.append(message)
            elif out and out[-1].role in ("user", "tool") and not pending:
                out[-1] = out[-1].model_copy(
                    update={"content": _join(out[-1].content, message.content)}
                )
            else:
                pending.append(message.content)
            continue
        leading = False
        if pending:
            if message.role in ("user", "tool"):
                message = message.model_copy(
                    update={"content": _join("\n\n".join(pending), message.content)}
                )
            else:
                out.append(Message(role="user", content="\n\n".join(pending)))
            pending = []
        out.append(message)
    if pending:
        out.append(Message(role="user", content="\n\n".join(pending)))
    return out


def _join(first: str, second: str) -> str:
    if not first:
        return second
    if not second:
        return first
    return f"{first}\n\n{second}"
