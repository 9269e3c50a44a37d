"""The web console end to end: a real gateway on loopback driven by headless Chromium.

Needs Debian's Chromium at /usr/bin/chromium (``make test`` installs it when it can) and the
``playwright`` package; Playwright's own browser download is not used.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from split_pictures import SELF, WHY, B, C, split_node

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.console import close_event_streams
from gateway.events import TextDelta
from gateway.testing import ScriptedUpstream, ServerThread, Stall, text_script
from gateway.upstream import ModelInfo, StaticDirectory

CHROMIUM = Path(os.environ.get("MLX_MESH_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path("/tmp/mlx-mesh-console.png")

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
if not CHROMIUM.exists():
    pytest.skip(
        f"no Chromium at {CHROMIUM}: run `apt-get install chromium` (make test does it as root)",
        allow_module_level=True,
    )

ANSWER = "Here is **bold** and `code`:\n\n- one\n- two\n\n```python\nprint('hi')\n```\nDone."


class Gateway:
    def __init__(self, api_key: str | None = None, moa: bool = False) -> None:
        self.tiny = ScriptedUpstream.of(
            *text_script(ANSWER, reasoning="Let me think about it.", chunk=4),
            name="local",
            delay_s=0.04,
        )
        self.endless = ScriptedUpstream.of(
            TextDelta("never "), TextDelta("ending "), Stall(), name="local"
        )
        directory = StaticDirectory()
        directory.add(ModelInfo(id="tiny"), self.tiny)
        directory.add(ModelInfo(id="endless"), self.endless)
        mixture = None
        if moa:
            from gateway.moa import MixtureOfAgents, MoaConfig

            only_tiny = StaticDirectory()
            only_tiny.add(ModelInfo(id="tiny"), self.tiny)
            mixture = MixtureOfAgents(only_tiny, MoaConfig(race_min_tokens=2))
        self.app = create_app(directory, GatewayConfig(api_key=api_key), moa=mixture)
        self.server = ServerThread(self.app)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        # Not the test run's LD_PRELOAD (OpenBLAS, for the MLX models): Chromium dies with it.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, env=env
        )
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway()
    with gw.server:
        yield gw


@pytest.fixture
def page(browser, gateway: Gateway):  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1280, "height": 820})
    context.set_default_timeout(10_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(gateway.server.url + "/")
    page.wait_for_selector("#model option[value='tiny']", state="attached")
    yield page
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def watch_text(page, selector: str) -> None:  # type: ignore[no-untyped-def]
    """Record every distinct text the element takes (once it exists) in window.__seen."""
    page.evaluate(
        """(selector) => {
            window.__seen = [];
            const note = () => {
                const el = document.querySelector(selector);
                if (el && el.textContent && window.__seen.at(-1) !== el.textContent)
                    window.__seen.push(el.textContent);
            };
            new MutationObserver(note).observe(document.body,
                {subtree: true, childList: true, characterData: true});
        }""",
        selector,
    )


def send(page, text: str, model: str = "tiny") -> None:  # type: ignore[no-untyped-def]
    page.select_option("#model", model)
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_chat_streams_markdown_in_pieces_with_reasoning_and_footer(page, gateway: Gateway) -> None:  # type: ignore[no-untyped-def]
    models = page.eval_on_selector_all("#model option", "els => els.map(e => e.value)")
    assert models == ["tiny", "endless", "mesh"]
    watch_text(page, ".msg.assistant .body")
    send(page, "Show me some markdown")
    page.wait_for_selector(".msg.assistant .footer[data-outcome='ok']", timeout=15_000)

    seen = page.evaluate("window.__seen")
    assert len(seen) >= 5, f"text arrived in {len(seen)} updates: {seen}"
    assert len(seen[0]) < 10 and seen[-1].endswith("Done."), seen  # partial first, whole last
    body = page.locator(".msg.assistant .body")
    assert body.locator("strong").inner_text() == "bold"
    assert body.locator("li").all_inner_texts() == ["one", "two"]
    assert body.locator("pre code").inner_text() == "print('hi')"
    # Reasoning is there but collapsed.
    details = page.locator(".msg.assistant details.reasoning")
    assert details.is_visible()
    assert details.get_attribute("open") is None
    assert page.locator(".reasoning-text").text_content() == "Let me think about it."
    footer = page.locator(".msg.assistant .footer").inner_text()
    assert "local" in footer and "TTFT" in footer and "tok/s" in footer
    assert gateway.tiny.requests[-1].messages[-1].content == "Show me some markdown"

    # The second turn carries the first one as history.
    send(page, "again")
    page.wait_for_function(
        "document.querySelectorAll(\".footer[data-outcome='ok']\").length === 2", timeout=15_000
    )
    history = gateway.tiny.requests[-1].messages
    assert [m.role for m in history] == ["user", "assistant", "user"]
    assert history[1].content == ANSWER

    page.screenshot(path=str(SCREENSHOT))

    # "New" starts over: the next request carries no history.
    page.click("#clear")
    assert page.locator(".msg").count() == 0
    send(page, "fresh start")
    page.wait_for_selector(".msg.assistant .footer[data-outcome='ok']", timeout=15_000)
    assert [m.content for m in gateway.tiny.requests[-1].messages] == ["fresh start"]


def test_stop_cancels_the_upstream(page, gateway: Gateway) -> None:  # type: ignore[no-untyped-def]
    cancelled_before = gateway.endless.cancelled
    send(page, "go on forever", model="endless")
    page.wait_for_function(
        "document.querySelector('.msg.assistant .body')?.textContent.includes('ending')"
    )
    assert page.locator("#stop").is_visible()
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .footer[data-outcome='stopped']")
    assert page.locator("#send").is_enabled()
    deadline = time.monotonic() + 10
    while gateway.endless.cancelled == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway.endless.cancelled == cancelled_before + 1
    assert gateway.endless.active == 0


def test_topology_and_node_table_show_this_node(page) -> None:  # type: ignore[no-untyped-def]
    page.click("[data-tab='mesh']")
    # The first status event (not the placeholder drawn at load) fills the node table.
    page.wait_for_selector("#nodes tbody tr")
    assert page.locator("#topology .node").count() == 1
    assert "tiny" in page.locator("#topology .node.self").inner_html()
    assert "tiny" in page.locator("#nodes tbody").inner_text()
    assert page.locator("#live").inner_text() == "live"
    assert page.locator("#split-section").is_hidden()  # nothing split here: no empty section


# ---------------------------------------------------------------- a split model's stages


@contextlib.contextmanager
def mesh_tab(browser, picture: dict) -> Iterator[object]:  # type: ignore[no-untyped-def]
    """The console's mesh tab on a node whose status picture is ``picture`` (changes to it reach
    the page through the live feed); fails on any JavaScript error on the page."""
    directory = StaticDirectory()
    directory.add(ModelInfo(id="tiny"), ScriptedUpstream.of(name="local"))
    server = ServerThread(create_app(directory, GatewayConfig(), status=lambda: picture))
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(10_000)
    errors: list[str] = []
    with server:
        page = context.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server.url + "/")
        page.click("[data-tab='mesh']")
        yield page
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def split_status() -> dict:
    """The split picture (tests/split_pictures.py) with peers whose strings are hostile."""
    return {
        "node": split_node(),
        "peers": [
            {"node_id": B, "state": "up", "connected": True, "models": [],
             "share_memory": 8_000_000_000, "share_memory_used": 2_500_000_000},
            # A peer's strings are drawn as text, never as markup.
            {"node_id": C, "state": "up", "connected": True,
             "models": [{"name": "<img src=x onerror=alert(1)>", "stages": [
                 {"rank": 1, "node_id": SELF, "start": 0, "end": 1},
                 {"rank": 0, "node_id": C, "start": 1, "end": 4}]}],
             "share_memory": 0, "share_memory_used": 0},
        ],
        "workers": {"BIG": {"restarts": 0}, "HUGE": {"restarts": 0, "split": {"waiting": WHY}}},
    }  # fmt: skip


def test_mesh_tab_draws_a_split_models_stages_and_a_waiting_one(browser) -> None:  # type: ignore[no-untyped-def]
    picture = split_status()
    with mesh_tab(browser, picture) as page:
        page.wait_for_selector("#split-section .split[data-model='BIG']")

        big = page.locator(f".split[data-model='BIG'][data-head='{SELF}']")
        stages = big.locator(".stage")
        assert stages.count() == 3
        # In layer order, each naming its node (this one as "this node"), layers and rank.
        assert [stages.nth(i).get_attribute("data-node-id") for i in range(3)] == [B, C, SELF]
        texts = [" ".join(stages.nth(i).inner_text().split()) for i in range(3)]
        assert texts[0] == f"{B[:8]} layers 0–9 rank 2", texts
        assert texts[1] == f"{C[:8]} layers 10–17 rank 1", texts
        assert texts[2] == "this node layers 18–23 rank 0 · serves", texts
        assert "24 layers over 3 ranks, served by this node" in " ".join(big.inner_text().split())
        # Widths follow the layer counts (10 : 8 : 6).
        widths = [stages.nth(i).bounding_box()["width"] for i in range(3)]
        assert widths[0] > widths[1] > widths[2], widths

        waiting = page.locator(".split.waiting[data-model='HUGE']")
        assert waiting.count() == 1  # once, though both the coordinator and the worker say it
        assert waiting.locator(".split-why").inner_text() == WHY
        offers = page.locator("#split-offers .tag").all_inner_texts()
        assert offers == [
            "this node offers 4.0 GB (1.2 GB in use)",
            f"{B[:8]} offers 8.0 GB (2.5 GB in use)",
        ], offers
        assert (
            "offers 8.0 GB (2.5 GB in use)"
            in page.locator(f"#nodes tr[data-node-id='{B}']").inner_text()
        )
        ranks = " ".join(page.locator("#split-ranks").inner_text().split())
        assert ranks == f"this node runs rank 1 of OTHER for {C[:8]}", ranks

        # The peer's split model: its name is text, the stage here says "this node".
        theirs = page.locator(f".split[data-head='{C}']")
        assert theirs.locator(".split-head b").inner_text() == "<img src=x onerror=alert(1)>"
        assert page.locator("#split-section img").count() == 0
        assert theirs.locator(".stage").first.inner_text().startswith("this node")

        page.locator("#split-section").screenshot(
            path=str(SCREENSHOT.with_name("mlx-mesh-console-split.png"))
        )

        # Members offer memory: HUGE's group forms, and the page follows the status feed.
        huge = [
            {"rank": 1, "node_id": B, "start": 0, "end": 2},
            {"rank": 0, "node_id": SELF, "start": 2, "end": 4},
        ]
        picture["node"]["models"].append({"name": "HUGE", "stages": huge})
        picture["node"]["split"]["waiting"] = {}
        picture["workers"]["HUGE"]["split"] = {"group": "g2", "stages": []}
        page.wait_for_selector(".split[data-model='HUGE'] .stage")
        assert page.locator(".split.waiting").count() == 0


def test_node_table_shows_every_node_prompt_cache(browser) -> None:  # type: ignore[no-untyped-def]
    """The mesh-wide view: each node's memory tier, disk tier, prefixes, hit rate and budget,
    as gossip brought them; an older peer (no summary) shows a dash; names are text."""
    summary = {"memory_bytes": 3_000_000, "disk_bytes": 70_000_000, "prefixes": 5,
               "lookups": 4, "hit_rate": 0.75, "cached_share": 0.5, "budget_bytes": 10**9,
               "budget_used_bytes": 4_000_000}  # fmt: skip
    picture = {
        "node": {"node_id": SELF, "models": [{"name": "tiny"}], "cache_stats": {"tiny": summary}},
        "peers": [
            {"node_id": B, "state": "up", "connected": True, "models": [],
             "cache_stats": {"<b>x</b>": {"prefixes": 1, "hit_rate": None}}},
            {"node_id": C, "state": "up", "connected": True, "models": []},
        ],
    }  # fmt: skip
    with mesh_tab(browser, picture) as page:
        page.wait_for_selector(f"#nodes tr[data-node-id='{SELF}'] .cache-line")
        mine = page.locator(f"#nodes tr[data-node-id='{SELF}'] td.caches").inner_text()
        assert " ".join(mine.split()) == (
            "tiny mem 3.0 MB · disk 70.0 MB · 5 prefixes · 75% hits of 4 · "
            "50% of tokens cached · budget 4.0 MB / 1.0 GB"
        ), mine
        theirs = page.locator(f"#nodes tr[data-node-id='{B}'] td.caches")
        assert " ".join(theirs.inner_text().split()) == (
            "<b>x</b> mem 0 B · disk 0 B · 1 prefixes · no lookups"
        )
        assert theirs.locator("b b").count() == 0  # the model name is text, not markup
        assert page.locator(f"#nodes tr[data-node-id='{C}'] td.caches").inner_text() == "–"
        # The feed follows: a hit moves the rate.
        picture["node"]["cache_stats"]["tiny"] |= {"lookups": 5, "hit_rate": 0.8}
        page.wait_for_function(
            f"document.querySelector(\"#nodes tr[data-node-id='{SELF}'] td.caches\")"
            ".textContent.includes('80% hits of 5')"
        )


def test_requests_table_fills_live(page, gateway: Gateway) -> None:  # type: ignore[no-untyped-def]
    # History first (loaded once at start), so the next row can only come over the live feed.
    history = len(httpx.get(gateway.server.url + "/api/requests").json()["requests"])
    rows = "document.querySelectorAll('#requests tbody tr').length"
    page.wait_for_function(f"{rows} === {history}")
    page.click("[data-tab='requests']")
    page.click("[data-tab='chat']")
    send(page, "count me")
    page.wait_for_selector(".msg.assistant .footer[data-outcome='ok']", timeout=15_000)
    page.click("[data-tab='requests']")
    page.wait_for_function(f"{rows} === {history + 1}", timeout=10_000)
    row = page.locator("#requests tbody tr").first.inner_text()
    assert "responses" in row and "tiny" in row and "ok" in row
    page.screenshot(path=str(SCREENSHOT.with_name("mlx-mesh-console-requests.png")))


def test_invite_without_a_mesh_says_so(page) -> None:  # type: ignore[no-untyped-def]
    page.click("[data-tab='mesh']")
    page.click("#invite-button")
    result = page.locator("#invite-result.error")
    result.wait_for()
    assert "mesh invite" in result.inner_text()


def test_markdown_renderer_escapes_html(page) -> None:  # type: ignore[no-untyped-def]
    html = page.evaluate(
        """async () => {
            const { renderMarkdown } = await import('/static/markdown.js');
            return renderMarkdown(
                '<img src=x onerror=alert(1)> **b** [x](javascript:alert(1))\\n\\n```\\n<b>code</b>\\n```'
            );
        }"""
    )
    assert "<img" not in html and "<b>code" not in html
    assert "&lt;img" in html and "&lt;b&gt;code&lt;/b&gt;" in html
    assert "<strong>b</strong>" in html
    assert "href" not in html  # only http(s) links become anchors


def test_api_key_is_asked_for_and_sent(browser) -> None:  # type: ignore[no-untyped-def]
    gw = Gateway(api_key="sekret")
    with gw.server:
        context = browser.new_context()
        page = context.new_page()
        page.goto(gw.server.url + "/")
        dialog = page.locator("#key-dialog")
        dialog.wait_for(state="visible")
        assert "needs an API key" in page.locator("#key-reason").inner_text()
        page.fill("#key-input", "sekret")
        page.press("#key-input", "Enter")
        page.wait_for_selector("#model option[value='tiny']", state="attached")
        assert page.evaluate("localStorage.getItem('mlx-mesh.api-key')") == "sekret"
        send(page, "with a key")
        page.wait_for_selector(".msg.assistant .footer[data-outcome='ok']", timeout=15_000)
        page.wait_for_function("document.querySelector('#live').textContent === 'live'")
        context.close()


# ---------------------------------------------------------------- a two-node mesh


class MeshNode:
    """A MeshService (real QUIC on loopback) under a real gateway, both on one server loop."""

    def __init__(
        self,
        home: Path,
        models: dict[str, ScriptedUpstream],
        join: str | None = None,
        copy: object | None = None,  # a CopyConfig: serve peer copies
    ):
        from mesh.http import mesh_routes
        from mesh.identity import NodeIdentity
        from mesh.service import MeshConfig, MeshService
        from mesh.tunnel.config import TunnelConfig

        local = StaticDirectory()
        for name, upstream in models.items():
            local.add(ModelInfo(id=name), upstream)
        config = MeshConfig(
            port=0,
            discovery=False,
            gossip_interval_s=0.2,
            redial_s=0.2,
            retry_backoff_s=0.05,
            join_token=join,
            tunnel=TunnelConfig(ping_interval=0.3, ping_timeout=1.0, handshake_timeout=3.0),
            copy=copy,  # type: ignore[arg-type]
        )
        self.service = MeshService(home, NodeIdentity.load_or_create(home), local, config)
        self.app = create_app(
            self.service.directory,
            extra_routes=mesh_routes(self.service, api_key=None),
            status=self.service.status,
        )
        self.server = ServerThread(self.app)

    def __enter__(self) -> MeshNode:
        self.server.__enter__()
        self.server.run(self.service.start())
        return self

    def __exit__(self, *exc: object) -> None:
        close_event_streams(self.app)  # as the node does: open consoles must not delay exit
        self.server.run(self.service.stop())
        self.server.__exit__(*exc)


def test_two_node_mesh_topology_forwarded_chat_and_invite(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    worker = ScriptedUpstream.of(
        *text_script("Answered by node A.", chunk=3), name="local", delay_s=0.03
    )
    other = ScriptedUpstream.of(*text_script("From B."), name="local")
    context = browser.new_context(viewport={"width": 1280, "height": 820})
    context.set_default_timeout(15_000)
    with MeshNode(tmp_path / "a", {"tiny": worker}) as a:
        page_a = context.new_page()
        page_a.goto(a.server.url + "/")
        page_a.wait_for_selector("#nodes tbody tr", state="attached")  # live, alone
        assert page_a.locator("#model option[value='other']").count() == 0
        token = a.server.run(on_loop(a.service.create_invite, 60)).encode()
        with MeshNode(tmp_path / "b", {"other": other}, join=token) as b:
            # B's model joins A's picker without a reload, once gossip brings it over.
            page_a.wait_for_selector("#model option[value='other']", state="attached")
            page = context.new_page()
            page.goto(b.server.url + "/")
            page.wait_for_selector("#model option[value='tiny']", state="attached")
            page.click("[data-tab='mesh']")
            page.wait_for_selector("#topology .node.peer.up")
            peer = page.locator("#topology .node.peer")
            assert peer.get_attribute("data-node-id") == a.service.node_id
            assert "tiny" in peer.inner_html()
            page.wait_for_function(
                "[...document.querySelectorAll('#topology .rtt')].some(t => t.textContent.endsWith('ms'))"
            )
            table = page.locator("#nodes tbody").inner_text()
            assert a.service.node_id[:8] in table and b.service.node_id[:8] in table
            page.screenshot(path=str(SCREENSHOT.with_name("mlx-mesh-console-mesh.png")))

            page.click("#invite-button")
            command = page.locator("#invite-command")
            command.wait_for()
            assert command.inner_text().startswith("mesh up --join mlxmesh1.")
            context.grant_permissions(["clipboard-read", "clipboard-write"])
            page.click("#invite-copy")
            page.wait_for_function(
                "document.querySelector('#invite-copy').textContent === 'Copied'"
            )
            assert page.evaluate("navigator.clipboard.readText()") == command.inner_text()

            page.click("[data-tab='chat']")
            send(page, "who answers?")
            page.wait_for_selector(".msg.assistant .footer[data-outcome='ok']")
            assert page.locator(".msg.assistant .body").inner_text() == "Answered by node A."
            footer = page.locator(".msg.assistant .footer").inner_text()
            assert "peer" in footer and a.service.node_id[:12] in footer
            assert worker.calls == 1

            # The Mesh tab lists the members and removes one (through the CSRF-guarded POST):
            # the mesh's creator, A, removes B (the creator itself cannot be removed).
            page_a.click("[data-tab='mesh']")
            members = page_a.locator("#members tbody")
            page_a.wait_for_function("document.querySelectorAll('#members tbody tr').length === 2")
            assert "this node" in members.inner_text()
            page_a.on("dialog", lambda dialog: dialog.accept())
            # The table re-renders with every status push (A's is busier than B's): a click in
            # the page itself, not one that waits for the button to hold still.
            page_a.eval_on_selector(
                f"[data-remove='{b.service.node_id}']", "button => button.click()"
            )
            page_a.wait_for_function(
                "document.querySelector('#members-result').textContent.startsWith('Removed')"
            )
            page_a.wait_for_function("document.querySelectorAll('#members tbody tr').length === 1")
    context.close()


def _weights(root: Path, mb: int) -> Path:
    """A stand-in model in a store: config + ``mb`` MB of random weights (never loaded)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(os.urandom(mb * 1_000_000))
    return root


def test_mesh_tab_copies_a_model_from_a_member_with_live_progress(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """B's console lists what A holds, copies it with live progress (bytes, rate, ETA, source),
    then a second copy whose source goes away mid-copy ends in one clear sentence."""
    from mesh.copy.server import CopyConfig
    from worker.store import model_path

    # Paced (1 MB/s per member after a 1 MB burst) so that the copy takes a few seconds.
    paced = CopyConfig(port=0, chunk_size=128 * 1024, rate_bytes_per_s=1_000_000)
    _weights(model_path(tmp_path / "a", "weights"), 3)
    _weights(model_path(tmp_path / "a", "other"), 6)
    _weights(model_path(tmp_path / "a", "third"), 6)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(20_000)
    errors: list[str] = []
    with MeshNode(tmp_path / "a", {}, copy=paced) as a:
        token = a.server.run(on_loop(a.service.create_invite, 60)).encode()
        with MeshNode(tmp_path / "b", {}, join=token, copy=CopyConfig(port=0)) as b:
            page = context.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(b.server.url + "/")
            page.click("[data-tab='mesh']")
            row = page.locator("#mesh-models tr[data-model='weights']")
            row.locator("button[data-copy='weights']").wait_for()
            assert a.service.node_id[:8] in row.inner_text()

            watch_text(page, ".copy[data-copy='weights'] .copy-line")
            row.locator("button[data-copy='weights']").click()
            box = page.locator(".copy[data-copy='weights']")
            page.wait_for_selector(".copy[data-copy='weights'][data-outcome]")
            assert box.get_attribute("data-outcome") == "done", box.inner_text()
            assert "Copied weights" in box.inner_text()
            seen = [t for t in page.evaluate("window.__seen") if " of " in t]
            assert len(seen) >= 3, seen  # it moved while we watched, not only at the end
            assert any("MB/s" in t and "ETA" in t for t in seen), seen
            assert all(f"from {a.service.node_id[:8]}" in t for t in seen[1:]), seen
            # Bytes only grow. (The last progress line may never be drawn on its own: when it
            # and the done event arrive in one read, the page goes straight to "Copied".)
            done_mb = [float(t.split(" ")[0]) if " MB of" in t else 0.0 for t in seen]
            assert done_mb == sorted(done_mb), seen
            copied = model_path(b.service.home, "weights") / "model.safetensors"
            original = model_path(a.service.home, "weights") / "model.safetensors"
            assert copied.read_bytes() == original.read_bytes()
            page.wait_for_function(
                "document.querySelector(\"#mesh-models tr[data-model='weights']\")"
                ".children[2].textContent === 'yes'"
            )
            assert page.locator("button[data-copy='weights']").count() == 0

            # Stop cancels the node's copy; what it had copied waits there for a resume.
            page.locator("button[data-copy='third']").click()
            page.wait_for_function(
                "(document.querySelector(\".copy[data-copy='third'] progress\")?.value || 0) > 0"
            )
            page.click("[data-stop-copy='third']")
            page.wait_for_selector(".copy[data-copy='third'][data-outcome='failed']")
            assert "Stopped" in page.locator(".copy[data-copy='third'] .copy-line").inner_text()
            page.locator("button[data-copy='third']").wait_for()  # can be started again
            partial = model_path(b.service.home, "third").parent / ".partial" / "third"
            assert partial.is_dir() and not model_path(b.service.home, "third").exists()

            # The source goes away mid-copy: one sentence, and what was copied is kept.
            page.locator("button[data-copy='other']").click()
            page.wait_for_function(
                "(document.querySelector(\".copy[data-copy='other'] progress\")?.value || 0)"
                " > 1500000"
            )
            shot = SCREENSHOT.with_name("mlx-mesh-console-copy.png")
            page.locator("#mesh-models-section").screenshot(path=str(shot))
            a.server.run(a.service.copy.server.close())
            page.wait_for_selector(".copy[data-copy='other'][data-outcome='failed']")
            line = page.locator(".copy[data-copy='other'] .copy-line").inner_text()
            assert "went away mid-copy" in line and "pull again to resume" in line, line
            assert line.count(". ") == 0 and "Traceback" not in line, line
            assert not model_path(b.service.home, "other").exists()
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


async def on_loop(fn, *args):  # type: ignore[no-untyped-def]
    """Wrap a plain call so ServerThread.run runs it on the server's loop (MeshService is not
    thread-safe)."""
    return fn(*args)


def test_mesh_model_shows_the_moa_winner(browser) -> None:  # type: ignore[no-untyped-def]
    gw = Gateway(moa=True)
    with gw.server:
        context = browser.new_context()
        context.set_default_timeout(15_000)
        page = context.new_page()
        page.goto(gw.server.url + "/")
        page.wait_for_selector("#model option[value='tiny']", state="attached")
        models = page.eval_on_selector_all("#model option", "els => els.map(e => e.value)")
        assert models.count("mesh") == 1
        send(page, "mix it", model="mesh")
        page.wait_for_selector(".msg.assistant .footer[data-outcome='ok']")
        assert page.locator(".msg.assistant .body").inner_text().endswith("Done.")
        assert "winner tiny" in page.locator(".msg.assistant .footer").inner_text()
        assert gw.tiny.calls >= 1
        context.close()


def test_an_unservable_model_shows_the_gateways_error(page) -> None:  # type: ignore[no-untyped-def]
    send(page, "anyone?", model="mesh")  # this gateway runs no mixture-of-agents
    page.wait_for_selector(".msg.assistant .footer[data-outcome='failed']")
    assert "mesh" in page.locator(".msg.assistant .error").inner_text()
    assert page.locator("#send").is_enabled()


def test_markdown_renderer_never_emits_foreign_markup(page) -> None:  # type: ignore[no-untyped-def]
    """Fuzz: random text from a markup-heavy alphabet only ever yields our own tags."""
    bad = page.evaluate(
        """async () => {
            const { renderMarkdown } = await import('/static/markdown.js');
            const allowed = new Set(['P','BR','PRE','CODE','STRONG','EM','UL','OL','LI','A',
                                     'H3','H4','H5','H6']);
            const alphabet = ['<', '>', '&', '"', "'", '*', '_', '`', '[', ']', '(', ')', '#',
                              '-', '1.', '\\n', ' ', 'a', 'b', 'script', 'img', 'onerror=',
                              'javascript:', 'http://x.y/', '```', '~~~'];
            let seed = 7;
            const rand = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
            const bad = [];
            for (let i = 0; i < 2000; i++) {
                let text = '';
                for (let j = rand(40); j > 0; j--) text += alphabet[rand(alphabet.length)];
                const tpl = document.createElement('template');
                tpl.innerHTML = renderMarkdown(text);
                for (const el of tpl.content.querySelectorAll('*')) {
                    const attrs = [...el.attributes].map((a) => a.name);
                    const href = el.getAttribute('href');
                    if (!allowed.has(el.tagName)
                        || attrs.some((a) => !['href', 'target', 'rel', 'class'].includes(a))
                        || (href !== null && !/^https?:\\/\\//.test(href))) {
                        bad.push([text, tpl.innerHTML]);
                        break;
                    }
                }
            }
            return bad.slice(0, 5);
        }"""
    )
    assert bad == []
