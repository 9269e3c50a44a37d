"""Compaction over a real worker (a tiny random-weight model): what it returns must make the next
turn's prompt shorter than the uncompacted one, or leave the conversation as it was."""

from __future__ import annotations

import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.responses.compacted import decode_history
from gateway.testing import ServerThread
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import WorkerClient
from worker.engine.core import Engine
from worker.serve.app import create_app as create_worker_app

pytestmark = pytest.mark.e2e

_ANSWER = " ".join(f"Step {i}: open file src/module_{i}.py and fix the import." for i in range(3))
HISTORY = [
    {"role": "user", "content": "Fix the imports in the project."},
    {"role": "assistant", "content": _ANSWER},
    {"role": "user", "content": "Did that work?"},
    {"role": "assistant", "content": "Yes. " + _ANSWER},
]
NEXT = {"role": "user", "content": "What next?"}


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    engine = Engine(str(tiny_model_dir), name="tiny")
    engine.start()
    try:
        with ServerThread(create_worker_app(engine)) as worker:
            directory = StaticDirectory()
            directory.add(ModelInfo(id="tiny"), WorkerClient(worker.url, "tiny"))
            store = tmp_path_factory.mktemp("home") / "responses.sqlite3"
            config = GatewayConfig(retry_backoff_ms=1, response_store=store)
            with ServerThread(create_app(directory, config)) as front:
                yield front
    finally:
        engine.close()


def _input_tokens(client: openai.OpenAI, items: list) -> int:
    turn = client.responses.create(model="tiny", input=items, max_output_tokens=1)
    assert turn.usage is not None
    return turn.usage.input_tokens


def test_compaction_shortens_the_next_turn_or_changes_nothing(gateway):
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0) as client:
        before = _input_tokens(client, [*HISTORY, NEXT])
        compacted = client.responses.with_raw_response.compact(model="tiny", input=HISTORY)
        output = compacted.http_response.json()["output"]
        after = _input_tokens(client, [*output, NEXT])
    compactions = [item for item in output if item["type"] == "compaction"]
    assert len(compactions) == 1  # always one, as the spec's endpoint answers
    carried = decode_history(compactions[0]["encrypted_content"])
    if carried is None:  # a summary
        assert after < before, (after, before, output)
    else:  # not worth compacting: the item carries the conversation as it was
        assert output == compactions
        assert [(i["role"], i["content"][0]["text"]) for i in carried] == [
            (m["role"], m["content"]) for m in HISTORY
        ]
        assert after == before
