"""A chat completions request as an engine job: the prompt (tools fitted to the context,
thinking, an output grammar or a forced tool call), its sampling, and the assembler that splits
the answer.

A client's mistake raises :class:`BadRequest` (the app answers it with a 400).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import jinja2

from worker.chat.next_turn import NextTurn
from worker.chat.output import DeltaAssembler
from worker.chat.prompt import ChatTemplate
from worker.chat.response_format import (
    OutputFormatError,
    agrammar_processor,
    answer_prompt,
    output_grammar,
)
from worker.chat.schemas import ChatCompletionRequest
from worker.chat.thinking import normalize_thinking
from worker.engine.core import Engine, Job
from worker.engine.types import GenerationRequest
from worker.sampling import SamplingParams
from worker.structured.processor import GrammarProcessor, special_token_id
from worker.tools import listing as tool_listing
from worker.tools.forced import ToolChoiceError, call_grammar, call_syntax, forced_names
from worker.tools.listing import Listing
from worker.tools.parsing import ToolCallSplitter

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 2048


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def context_overflow(prompt_tokens: int, context: int) -> BadRequest:
    """The 400 for a prompt the model cannot hold. Its words are Anthropic's, which Claude Code
    parses to compact the conversation and retry (any other wording ends its session); OpenAI
    clients (OpenCode, Codex CLI) read the code, and OpenCode the words too."""
    return BadRequest(
        f"prompt is too long: {prompt_tokens} tokens > {context} maximum (the model's context"
        " length)",
        "messages",
        "context_length_exceeded",
    )


async def start_job(
    engine: Engine, template: ChatTemplate, chat: ChatCompletionRequest, body: dict[str, Any]
) -> tuple[Job, DeltaAssembler, Listing, NextTurn | None]:
    """Render ``chat`` through ``template`` (its model's, which ``engine`` serves), submit the
    job, and return it with the assembler that splits its answer, the tools' listing and the
    conversation as a next turn renders it (None: no next turn follows). Raises
    :class:`BadRequest`."""
    template_kwargs = dict(chat.chat_template_kwargs or {})
    thinking = normalize_thinking(body)
    if thinking is not None:
        template_kwargs["enable_thinking"] = thinking
    messages = [m.to_template() for m in chat.messages]
    # tool_choice "none": the model is not offered the tools, so it cannot call them.
    offered = chat.tools if chat.tool_choice != "none" else None
    tools = [t.model_dump(exclude_none=True) for t in offered] if offered else None
    grammar = _output_grammar(chat, bool(tools))
    try:
        forced = forced_names(chat.tool_choice, tools)
    except ToolChoiceError as exc:
        raise BadRequest(str(exc), "tool_choice") from exc
    if forced and tools:
        grammar = await asyncio.to_thread(_call_grammar, engine.tokenizer, tools, forced)
    if grammar is not None:
        template_kwargs["enable_thinking"] = (
            False  # the grammar holds the answer, not a think block
        )
    context = engine.info.context_length
    try:
        (prompt, in_reasoning), listing = await asyncio.to_thread(
            fitted_prompt, template, context, messages, tools, template_kwargs
        )
    except jinja2.TemplateError as exc:
        raise BadRequest(f"the chat template rejected the messages: {exc}", "messages") from exc
    if len(prompt) >= context:
        raise context_overflow(len(prompt), context)
    try:
        logit_bias = chat.logit_bias_ids()
    except ValueError as exc:
        raise BadRequest(str(exc), "logit_bias") from exc
    vocab = len(engine.tokenizer)
    if logit_bias and any(not 0 <= t < vocab for t in logit_bias):
        raise BadRequest(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    processors: tuple[GrammarProcessor, ...] = ()
    if grammar is not None:
        prompt, in_reasoning = answer_prompt(engine.tokenizer, prompt, in_reasoning), False
        processors = (await _grammar_processor(engine, grammar),)
    limit = chat.max_completion_tokens or chat.max_tokens or DEFAULT_MAX_TOKENS
    defaults = engine.sampling_defaults  # for the fields the request leaves out
    temperature = defaults.temperature if chat.temperature is None else chat.temperature
    if chat.temperature is None and chat.min_temperature is not None:
        temperature = max(temperature, chat.min_temperature)
    sampling = SamplingParams(
        temperature=temperature,
        top_p=defaults.top_p if chat.top_p is None else chat.top_p,
        top_k=defaults.top_k if chat.top_k is None else chat.top_k,
        min_p=defaults.min_p if chat.min_p is None else chat.min_p,
        seed=chat.seed,
        repetition_penalty=chat.repetition_penalty,
        presence_penalty=chat.presence_penalty,
        frequency_penalty=chat.frequency_penalty,
        logit_bias=logit_bias,
    )
    job = engine.submit(
        GenerationRequest(
            prompt=prompt,
            max_tokens=max(1, min(limit, context - len(prompt))),
            sampling=sampling,
            stop=chat.stop_strings(),
            logprobs=bool(chat.logprobs),
            top_logprobs=(chat.top_logprobs or 0) if chat.logprobs else 0,
            logits_processors=processors,
        )
    )
    tok = engine.tokenizer
    splitter = None
    if tools:
        syntax = call_syntax(tok)
        splitter = ToolCallSplitter(
            start=syntax.start, end=syntax.end, parser=syntax.parser, tools=tools
        )
    # A held answer is all content: a think tag spelled inside a JSON string stays in it.
    think_tags = (tok.think_start, tok.think_end) if tok.has_thinking and grammar is None else None
    assembler = DeltaAssembler(
        think_tags=think_tags, in_reasoning=in_reasoning, tool_splitter=splitter
    )
    turn = NextTurn(template, messages, tools, template_kwargs, listing)
    return job, assembler, listing, turn if chat.cache_next_turn else None


def listing_header(listing: Listing) -> dict[str, str]:
    """``x-tools-listing: brief|names`` when the tools were shortened to fit the context."""
    return {} if listing == "full" else {"x-tools-listing": listing}


def fitted_prompt(
    template: ChatTemplate,
    context: int,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
) -> tuple[tuple[list[int], bool], Listing]:
    """The prompt with the tools listed as fully as the context allows (worker.tools.listing)."""
    if not tools:
        return template.render(messages, None, template_kwargs), "full"
    sizes: dict[str, int] = {}

    def render(listing: Listing) -> tuple[list[int], bool]:
        rendered = template.render(messages, tools, template_kwargs, listing)
        sizes[listing] = len(rendered[0])
        return rendered

    rendered, listing = tool_listing.fit(render, lambda prompt: len(prompt[0]), context)
    if listing != "full":
        log.info(
            "%d tools listed %s: prompt %d tokens (%d with the full listing), context %d",
            len(tools), listing, sizes[listing], sizes["full"], context,
        )  # fmt: skip
    return rendered, listing


def _output_grammar(chat: ChatCompletionRequest, tools_offered: bool) -> str | None:
    try:
        return output_grammar(chat.response_format, tools_offered)
    except OutputFormatError as exc:
        raise BadRequest(str(exc), exc.param) from exc


def _call_grammar(
    tokenizer: Any, tools: list[dict[str, Any]], names: tuple[str, ...]
) -> str | None:
    """The grammar that makes the answer one call to one of ``names``, in this model's call
    syntax; None (the choice is not enforced) where that syntax has no grammar."""
    syntax = call_syntax(tokenizer)
    try:
        grammar = call_grammar(syntax, tools, names, lambda text: special_token_id(tokenizer, text))
    except (ValueError, TypeError, AttributeError) as exc:  # a tokenizer llguidance cannot read
        log.warning("tool_choice not enforced: %s", exc)
        return None
    if grammar is None:
        log.warning("tool_choice not enforced: no grammar for this model's tool-call syntax")
    return grammar


async def _grammar_processor(engine: Engine, grammar: str) -> GrammarProcessor:
    try:
        return await agrammar_processor(engine.tokenizer, grammar)
    except OutputFormatError as exc:
        raise BadRequest(str(exc), exc.param) from exc
