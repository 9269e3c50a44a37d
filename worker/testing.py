"""Tiny random-weight models for tests: a real MLX llama directory that ``mlx_lm.load`` reads.

``make_tiny_model`` writes ``config.json``, ``model.safetensors``, a byte-level BPE
``tokenizer.json`` and a ``tokenizer_config.json`` with a ChatML-like chat template that renders
tools, tool calls and ``enable_thinking``. Building one takes well under a second.

A *script* makes the output meaningful: the transformer blocks are silenced (their output
projections zeroed) so the next token depends only on the current one, and the embedding and
``lm_head`` rows are set so that after the generation prompt the model emits the script's pieces in
order, then ``<|im_end|>``. Without a script the weights are random and the output is junk (but
deterministic for a seed; special tokens are never favoured so greedy junk runs to ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from worker.engine.types import Finished, TokenChunk

if TYPE_CHECKING:
    from worker.engine.core import Engine, Job

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# What the scripted think model says with thinking on; with thinking off the prompt already closes
# the think block with "\n\n", so generation starts at "The".
THINK_SCRIPT = ("Let", " me", " think", "</think>", "\n\n", "The", " answer", " is", " 4", ".")
# A scripted tool call (the JSON is one added token, so the script has no repeated token).
TOOL_SCRIPT = (
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    "</tool_call>",
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today? "
    "I am a tiny language model used in tests. system user assistant tool "
    "What is the weather in Paris? It is sunny. Please answer briefly. "
    '{"name": "get_weather", "arguments": {"city": "Paris"}} function parameters type object '
    "0123456789 + - * / = ( ) [ ] { } , . ; : ' \" \n\n "
)

_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call functions. Signatures:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{# rendered above #}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- if message.tool_calls %}{% for tc in message.tool_calls %}
{%- set tool_call = tc.function if tc.function is defined else tc %}<tool_call>
{"name": {{ tool_call.name | tojson }}, "arguments": {% if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool
{{ message.content or '' }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content or '' }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
THINK_TAIL{% endif %}"""

_THINK_TAIL = (
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)


def chat_template(*, think: bool) -> str:
    """The jinja chat template of a tiny model (the think variant opens ``<think>``)."""
    return _TEMPLATE.replace("THINK_TAIL", _THINK_TAIL if think else "")


def _build_tokenizer(extra_pieces: Sequence[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in MARKUP_TOKENS])
    for piece in extra_pieces:
        if piece not in tokenizer.get_vocab() and len(tokenizer.encode(piece).ids) != 1:
            tokenizer.add_tokens([AddedToken(piece, normalized=False)])
    return tokenizer


def _single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text).ids
    if len(ids) != 1:
        raise ValueError(f"script piece {text!r} is {len(ids)} tokens, need exactly one")
    return ids[0]


def _script_starts(tokenizer, template: str, think: bool) -> list[int]:
    """The last prompt token for each thinking mode: where the scripted chain begins."""
    import jinja2

    env = jinja2.Environment()
    env.filters["tojson"] = json.dumps
    tmpl = env.from_string(template)
    msgs = [{"role": "user", "content": "Hi"}]
    modes = [True, False] if think else [None]
    starts = []
    for mode in modes:
        kwargs = {} if mode is None else {"enable_thinking": mode}
        text = tmpl.render(messages=msgs, tools=None, add_generation_prompt=True, **kwargs)
        starts.append(tokenizer.encode(text).ids[-1])
    return starts


def make_tiny_model(
    path: str | Path,
    *,
    think: bool = False,
    seed: int = 0,
    script: Sequence[str] | None = None,
    max_position_embeddings: int = 4096,
    sliding_window: int | None = None,
    num_layers: int = 2,
) -> Path:
    """Write a tiny llama MLX model directory at ``path`` and return it.

    ``think`` selects the chat template that opens ``<think>`` in the generation prompt (unless
    ``enable_thinking`` is false, then it renders an empty closed block). ``script`` makes the
    model emit those text pieces (each becomes one token) after the generation prompt.
    ``sliding_window`` makes the first layer attend to that many tokens only (its KV cache is a
    ``RotatingKVCache``, as in gemma3's local layers); the second stays global (with more
    than two ``num_layers`` they alternate).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pieces = list(script or ())
    tokenizer = _build_tokenizer(pieces)
    vocab_size = tokenizer.get_vocab_size()
    template = chat_template(think=think)

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": num_layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
        "bos_token_id": None,
    }
    if sliding_window is not None:
        kinds = ("sliding_attention", "full_attention")
        config["layer_types"] = [kinds[i % 2] for i in range(num_layers)]
        config["sliding_window"] = sliding_window
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    special_ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS]

    embed = rng.normal(0.0, 1.0, (vocab_size, hidden)).astype(np.float32)
    head = rng.normal(0.0, 1.0 / np.sqrt(hidden), (vocab_size, hidden)).astype(np.float32)
    # Junk never ends early and never opens markup, even when sampled at temperature 1: feature 0
    # is a large constant in every embedding, so after the final norm it acts as a bias, and the
    # special rows weigh it strongly negative (p(special) per step ~1e-17 instead of ~1.5 %).
    embed[:, 0] = 8.0
    head[:, 0] = 0.0
    head[special_ids] = 0.0
    head[special_ids, 0] = -8.0
    if pieces:
        # Silence the blocks: the residual stream is then just the current token's embedding.
        for name in weights:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = np.zeros_like(weights[name])
        chain_ids = [_single_token(tokenizer, p) for p in pieces]
        starts = _script_starts(tokenizer, template, think)
        successors: dict[int, int] = {}
        for start in starts:
            if start not in chain_ids:
                successors[start] = chain_ids[0]
        ends = [*chain_ids[1:], tokenizer.token_to_id("<|im_end|>")]
        for current, nxt in zip(chain_ids, ends, strict=True):
            successors[current] = nxt
        if len(set(chain_ids)) != len(chain_ids):
            raise ValueError("script pieces must be distinct tokens")
        # Orthonormal embeddings for the chain tokens make each successor an exact argmax.
        members = sorted(successors)
        basis, _ = np.linalg.qr(rng.normal(size=(hidden, len(members))))
        head[:] = 0.0
        for col, token in enumerate(members):
            embed[token] = basis[:, col] * np.sqrt(hidden)
            head[successors[token]] += basis[:, col] * 8.0
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head

    mx.save_safetensors(
        str(path / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_position_embeddings,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def make_tiny_gemma3_model(
    path: str | Path, *, seed: int = 0, num_layers: int = 6, sliding_window: int = 4
) -> Path:
    """Write a tiny random-weight gemma3 (text) MLX model directory at ``path``: the tiny
    tokenizer and plain template, ``num_layers`` layers of which every third is global and the
    others slide over ``sliding_window`` tokens (``RotatingKVCache``), tied embeddings.
    Its output is junk, deterministic for a seed: for comparing two ways of running it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(())
    config = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": num_layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": tokenizer.get_vocab_size(),
        "sliding_window": sliding_window,
        "sliding_window_pattern": 3,
        "max_position_embeddings": 4096,
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
    }
    mx.random.seed(seed)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights.pop("lm_head.weight", None)  # tied, as gemma3 ships
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template(think=False),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def quantize_tiny_model(path: str | Path, *, bits: int = 4, group_size: int = 32) -> Path:
    """Rewrite a tiny model directory (``make_tiny_model``) with its linear and embedding
    weights quantized the way ``mlx_lm.convert`` does, so ``mlx_lm.load`` builds
    ``QuantizedLinear``/``QuantizedEmbedding`` layers from it. Returns the directory."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.utils import quantize_model

    path = Path(path)
    model, _, config = load(str(path), return_config=True)
    model, config = quantize_model(model, config, group_size, bits)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@contextlib.contextmanager
def run_worker_in_thread(
    model_dir: str | Path, *, name: str | None = None, config: Any = None, secret: str | None = None
) -> Iterator[tuple[str, Any]]:
    """Serve a model with the real worker app on 127.0.0.1 (free port) in a background thread.

    Yields ``(base_url, engine)``; ``base_url`` ends in ``/v1``. For tests of HTTP clients.
    """
    import uvicorn

    from worker.engine.core import Engine
    from worker.serve.app import create_app
    from worker.serve.net import bind_socket, server_limits

    engine = Engine(str(model_dir), name=name, config=config)
    engine.start(timeout=120)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(engine, secret=secret),
            log_level="warning",
            access_log=False,
            lifespan="off",
            **server_limits(),
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("worker server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}/v1", engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        engine.close()


class PrefillSpy:
    """Watches the prefill of an engine's model: each forward pass over more than one token (a
    prefill chunk) is counted in ``chunks`` (its length) and ``rows`` (how many prompts it ran)
    and, if set, ``on_chunk(n)`` is called with its number as the n-th one starts, on the
    engine's owner thread (so a test can cancel at an exact chunk: MLX builds the chunk's graph
    before it runs it).

    Install with ``PrefillSpy.install(engine)`` on a started engine; it wraps the model's first
    layer, so it sees every generator and cache type alike."""

    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.rows: list[int] = []
        self.on_chunk: Callable[[int], None] | None = None

    @classmethod
    def install(cls, engine: Any) -> PrefillSpy:
        import mlx.nn as nn

        spy = cls()

        class SpiedLayer(nn.Module):
            def __init__(self, inner: Any) -> None:
                super().__init__()
                self.inner = inner

            def __getattr__(self, key: str) -> Any:
                try:
                    return super().__getattr__(key)
                except AttributeError:  # what the model reads off its layers (use_sliding)
                    if key == "inner":
                        raise
                    return getattr(self["inner"], key)

            def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
                if x.shape[1] > 1:
                    spy._saw(x.shape[1], x.shape[0])
                return self.inner(x, *args, **kwargs)

        layers = engine._model.layers
        layers[0] = SpiedLayer(layers[0])
        return spy

    def reset(self) -> None:
        self.chunks.clear()
        self.rows.clear()
        self.on_chunk = None

    def _saw(self, tokens: int, rows: int) -> None:
        self.chunks.append(tokens)
        self.rows.append(rows)
        if self.on_chunk is not None:
            self.on_chunk(len(self.chunks))


async def collect_logprobs(engine: Engine, job: Job) -> tuple[list[tuple[str, float]], Finished]:
    """Drain ``job`` (submitted with ``logprobs=True``) to its terminal event: each token with
    its logprob (equal logprobs: equal KV before it), and the ``Finished``; commits the job to
    the prompt cache, as the app does."""
    tokens: list[tuple[str, float]] = []
    async for event in job.events():
        if isinstance(event, TokenChunk):
            tokens.extend((e.token, e.logprob) for e in event.logprobs or [])
        else:
            assert isinstance(event, Finished), event
            engine.commit(job)
            return tokens, event
    raise AssertionError("no terminal event")


async def wait_until(predicate: Callable[[], bool], limit_s: float = 60.0) -> None:
    """Poll ``predicate`` until it holds (an engine's stats, a job's events); fail after
    ``limit_s`` rather than hang the test."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)
