"""The serving server's capture rows are the driven engine's features of the same sequence.

In-process: the tiny chat target behind `Generator` (KV-cache decoding, waves of several
requests, left-padded), a stand-in sink recording what it is handed, and `HFEngine.capture` (the
driven capture path) on `prompt + output[:-1]` as the reference.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from specbus.core.config import TargetConfig
from specbus.core.models.target import load_target_info
from specbus.core.strategies.base import build_strategy
from specbus.producers.engines.hf import HFEngine
from specbus.producers.live.generate import Generator, Job
from specbus.producers.live.manifest import capture_config
from specbus.producers.live.sink import CaptureSink
from specbus.producers.live.wire import sample_id_of

from tests.fixtures.live import live_config


class RecordingSink(CaptureSink):
    """A sink with a known handshake whose writer only keeps what it is handed."""

    def __init__(self, cfg):
        super().__init__("http://unused", "unused", server_id="t", engine="hf")
        self.config = cfg
        self.handed = []

    def submit(self, capture) -> bool:
        self.handed.append(capture)
        return True


@pytest.fixture
def engine(chat_target):
    engine = HFEngine(TargetConfig(model=str(chat_target), dtype="float32", device="cpu"))
    yield engine
    engine.close()


def run_jobs(generator: Generator, jobs: list[Job], start: bool = False) -> None:
    async def go():
        for job in jobs:
            assert generator.submit(job)
        if start:
            generator.start()
        for job in jobs:
            while (await job.events.get())[0] != "done":
                pass

    asyncio.run(go())


@pytest.mark.parametrize("strategy", ["eagle3", "dflash", "dspark"])
def test_wave_captures_equal_the_driven_engines_features(engine, chat_target, tmp_path, strategy):
    """Every strategy's features (aux layers; the final norm's output for eagle3's target and
    dspark) as the driven engine captures them (domino's contract is dflash's)."""
    cfg = live_config("serve", tmp_path, chat_target, tmp_path / "none.jsonl", store_uri="mem://x",
                      strategy=strategy)  # fmt: skip
    info = load_target_info(chat_target)
    contract = build_strategy(cfg.strategy, info).feature_contract(info)
    cap = capture_config(cfg, contract, store_uri="mem://x", store_id="x", float_dtype="float32",
                         target_fingerprint="t", tokenizer_fingerprint="k")  # fmt: skip
    sink = RecordingSink(cap)
    tok = engine.tokenizer
    prompts = ["hi", "what is the sum of 12 and 30?", "seven apples", "add"]
    solo = Generator(engine, sink, max_new_tokens=12)
    alone = Job(request_id="solo", prompt_ids=tok.encode(prompts[1]), max_tokens=9, temperature=0)
    try:
        run_jobs(solo, [alone])  # a wave of one
    finally:
        solo.close()
    # all four queued before the worker starts: one wave, prompts of different lengths
    generator = Generator(engine, sink, max_new_tokens=12, max_batch=4, start=False)
    jobs = [Job(request_id=f"r{i}", prompt_ids=tok.encode(p), max_tokens=6 + i, temperature=0)
            for i, p in enumerate(prompts)]  # fmt: skip
    try:
        run_jobs(generator, jobs, start=True)
    finally:
        generator.close()
    assert solo.stats["waves"] == 1 and generator.stats["waves"] == 1
    by_id = {c.request_id: c for c in sink.handed}
    assert set(by_id) == {"solo", "r0", "r1", "r2", "r3"}
    assert by_id["r1"].output_ids[:6] == by_id["solo"].output_ids[:6]  # batching is transparent
    compared = 0
    for job in [alone, *jobs]:
        c = by_id[job.request_id]
        assert c.sample_id == sample_id_of(job.request_id)
        assert c.output_ids == job.output_ids and 1 <= len(c.output_ids) <= job.max_tokens
        tensors = sink.tensors(c, cap)
        if tensors is None:  # stopped at EOS before min_num_tokens generated rows
            continue
        seq = c.prompt_ids + c.output_ids[:-1]
        assert tensors["input_ids"].tolist() == seq
        n_prompt = len(c.prompt_ids)
        assert tensors["loss_mask"].tolist() == [0] * n_prompt + [1] * (len(seq) - n_prompt)
        (ref,) = engine.capture([torch.tensor(seq)], None, contract)
        floats = [n for n in contract.names if n not in ("input_ids", "loss_mask")]
        assert floats and set(tensors) == set(contract.names)
        for name in floats:
            assert tensors[name].shape == ref[name].shape, name
            torch.testing.assert_close(tensors[name], ref[name], atol=2e-4, rtol=1e-3)
        compared += 1
    assert compared >= 4


def test_openai_endpoints_with_the_real_client(engine, chat_target):
    """`/v1/completions` and `/v1/chat/completions`, streaming or not, through AsyncOpenAI on a
    real uvicorn server (no capture: `--no-capture`); bad requests get a 400 with a message."""
    import httpx
    from openai import APIStatusError, OpenAI

    generator = Generator(engine, None, max_new_tokens=8, max_batch=2)
    with (
        _serving(generator) as url,
        OpenAI(base_url=url + "/v1", api_key="u", max_retries=0) as client,
    ):
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "add 12 and 30"}], max_tokens=5,
            temperature=0, extra_headers={"X-Request-Id": "fixed-1"},
        )  # fmt: skip
        assert chat.id == "chatcmpl-fixed-1" and chat.usage.completion_tokens <= 5
        streamed = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "add 12 and 30"}], max_tokens=5,
            temperature=0, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(streamed)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content  # greedy: the same answer either way
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        done = client.completions.create(
            model="tiny", prompt="the sum of", max_tokens=4, temperature=0
        )
        assert done.object == "text_completion" and done.usage.prompt_tokens == len("the sum of")
        parts = list(client.completions.create(model="tiny", prompt="the sum of", max_tokens=4,
                                               temperature=0, stream=True))  # fmt: skip
        assert "".join(p.choices[0].text for p in parts) == done.choices[0].text
        ids = client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0.8, seed=3
        )
        assert ids.usage.prompt_tokens == 3
        for bad in ({"messages": []}, {"messages": [{"role": "user", "content": "x"}], "n": 2},
                    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
                    {"messages": [{"role": "user", "content": "x"}], "temperature": 9}):  # fmt: skip
            with pytest.raises(APIStatusError) as err:
                client.chat.completions.create(model="tiny", **bad)
            assert err.value.status_code == 400
        assert httpx.post(url + "/v1/completions", content=b"{not json").status_code == 400


def _up(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _serving(generator: Generator):
    """`specbus serve`'s app and uvicorn config (`ops.live.http_config`) over `generator`, in a
    thread on a free loopback port, until the block ends; yields its URL. Then the server
    stops and the generator is closed."""
    import threading

    import uvicorn
    from specbus.ops.live import bind, http_config
    from specbus.ops.services.common import free_port
    from specbus.producers.live.serve import Server, build_app

    from tests.fixtures.live import wait_until

    port = free_port()
    server = uvicorn.Server(http_config(build_app(Server(generator, "tiny"))))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[bind("127.0.0.1", port)])),
                              daemon=True)  # fmt: skip
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url), 30, "the server")
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        generator.close()


def test_an_idle_connection_outlives_the_clients_pool(engine):
    """The intake's and `specbus serve`'s uvicorn config keeps an idle keep-alive connection
    open past httpx's 5 s pool expiry: a client that reuses it after 6 s idle gets an answer,
    not "Server disconnected" (uvicorn's default, 5 s, raced the openai client in CI)."""
    import http.client
    import json
    import time
    from urllib.parse import urlsplit

    from specbus.ops.live import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > 15  # above httpx's (5 s) and aiohttp's (15 s) pool expiry
    generator = Generator(engine, None, max_new_tokens=4, max_batch=1)
    answers, sockets = [], []
    with _serving(generator) as url:
        conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=10)
        for idle in (0.0, 6.0):  # 6 s: past uvicorn's default keep-alive
            time.sleep(idle)  # the idle time under test, not a wait for readiness
            conn.request("GET", "/v1/models")  # on the same connection (HTTP/1.1 keep-alive)
            sockets.append(conn.sock)
            response = conn.getresponse()  # RemoteDisconnected if the server closed it
            answers.append((response.status, json.loads(response.read())["data"][0]["id"]))
        conn.close()
    assert answers == [(200, "tiny")] * 2 and sockets[0] is sockets[1]
