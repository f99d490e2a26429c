"""Every route of the live intake and of `specbus serve`, fuzzed with hypothesis over real HTTP.

The intake runs against a real broker and a real shm store, and is hit with and without the
bearer token. Its contract (`producers/live/refusals.py`, docs/live.md "Answers"): a request
is answered 2xx, a 4xx with a machine-readable reason (its fault) or 503 (the broker or the
store cannot serve now); never another 5xx, never a hang; and it serves valid requests
afterwards. `specbus serve` (the tiny chat target, real generation) answers 2xx, 400 or 503
(overloaded), with no error event inside a stream either. Hostile inputs are drawn on purpose:
ids and numbers in other scripts' digits ("²", "٣"), signs, spaces, "_", sequences 0, -1,
2^63, 2^64, huge integers in bodies, non-finite and tiny floats, wrong types, malformed JSON,
oversize and chunked bodies, odd headers.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from specbus.bus.connection import connect
from specbus.bus.headers import MSG_ID
from specbus.bus.publisher import Publisher
from specbus.bus.subjects import Names
from specbus.core.config import BusConfig
from specbus.producers.live.driven import OUTCOMES_PATH, TASKS_PATH
from specbus.producers.live.wire import CONFIG_PATH, RECORDS_PATH, driven_rid

from tests.fixtures.live import start_intake_thread
from tests.fixtures.nats import make_task
from tests.test_live_intake import put_capture

TOKEN = "fuzz-token"
NUM_TASKS = 3  # TASKS seqs 1..3 are tasks, seq 4 is not a record at all
OURS = (CONFIG_PATH, RECORDS_PATH, TASKS_PATH, OUTCOMES_PATH, "/metrics", "/healthz")

# Numbers as a request spells them: what a lax parser (str.isdigit, int, float) takes and the
# broker refuses or chokes on, and the edges of what it accepts.
HOSTILE_NUMBERS = [
    "0", "-1", "1", "01", "+1", " 1", "1 ", "1_0", "²", "٣", "１", "1.0", "1e3", "0x10", "",
    str(2**63 - 1), str(2**63), str(2**64 - 1), str(2**64), "9" * 30, "9" * 5000,
    "nan", "inf", "-inf", "1e400", "-0",
]  # fmt: skip
numbers = st.sampled_from(HOSTILE_NUMBERS) | st.integers().map(str) | st.text(max_size=12)


def _short_wait(text: str) -> bool:
    """Waits Python reads as more than 50 ms are left out of the random ones: a valid long
    poll is not a hang, but would make the test slow (the hostile list is always kept)."""
    try:
        return not float(text) > 0.05
    except ValueError:
        return True


waits = st.sampled_from(HOSTILE_NUMBERS) | st.text(max_size=12).filter(_short_wait)
# h11 (the client) sends printable ASCII header values without outer whitespace only
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30).map(
    str.strip
)


def _publish_tasks(url: str, run: str) -> None:
    """Tasks at TASKS seqs 1..NUM_TASKS, and bytes that are no record at seq NUM_TASKS + 1."""

    async def go():
        async with await connect(BusConfig(), url) as bus:
            pub = Publisher(bus)
            tasks = [make_task(run, i) for i in range(NUM_TASKS)]
            acks = await pub.publish_many(Names(run).tasks, tasks)
            assert [a.seq for a in acks] == list(range(1, NUM_TASKS + 1))
            (ack,) = await pub.publish_payloads([(Names(run).tasks, b"\x00garbage", {MSG_ID: "g"})])
            assert ack.seq == NUM_TASKS + 1

    asyncio.run(go())


@pytest.fixture
def intake(tmp_path, chat_target, nats_server, run_id):
    cfg, store, cap, thread = start_intake_thread(run_id, tmp_path, chat_target, nats_server.url,
                                                  TOKEN)  # fmt: skip
    _publish_tasks(nats_server.url, run_id)
    yield cfg, store, cap, thread
    thread.stop()
    store.close()


def regen(rec: dict, gen: str) -> dict:
    """A record (as JSON) whose keys name generation `gen` (as spelled, hostile or not)."""
    features = {name: {**spec, "key": spec["key"].replace("/g0/", f"/g{gen}/")}
                for name, spec in rec["features"].items()}  # fmt: skip
    return {**rec, "features": features}


def driven_body(driven: dict, seq: str, gen: str = "0") -> bytes:
    """A driven record (`driven`, a valid one's JSON) under the request id of TASKS `seq`, its
    keys under generation `gen`."""
    rid = f"specbus-task:{seq}:{driven['sample_id']}"
    return json.dumps({**regen(driven, gen), "request_id": rid}, ensure_ascii=False).encode()


def _bodies(good: dict, driven: dict):
    """POST /records bodies: near-valid records with fields replaced by any JSON, huge or
    spelled numbers, driven records with hostile sequences and key generations, records with
    hostile key generations, any JSON, any bytes."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=10)  # fmt: skip
    near_valid = st.fixed_dictionaries(
        {}, optional={k: values | st.just(v) for k, v in good.items()}
    ).map(lambda d: json.dumps(d).encode())
    big = st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -(2**63), -1, 0])
    numeric = st.sampled_from(["num_tokens", "num_prompt_tokens", "created_at", "schema_version"])
    huge = st.builds(lambda k, n: json.dumps({**good, k: n}).encode(), numeric,
                     big | st.sampled_from(HOSTILE_NUMBERS))  # fmt: skip
    gens = st.just("0") | st.sampled_from(HOSTILE_NUMBERS)
    driven_bodies = st.builds(lambda seq, gen: driven_body(driven, seq, gen), numbers, gens)
    regens = gens.map(lambda gen: json.dumps(regen(good, gen), ensure_ascii=False).encode())
    anything = st.binary(max_size=300) | values.map(lambda v: json.dumps(v).encode())
    return near_valid | huge | driven_bodies | regens | anything


OVERSIZE = ("plain", "chunked")  # a body over max_record_bytes, in one piece or chunked


def _requests(good: dict, driven: dict):
    """(method, path, query, body) for every route of the intake, and for none."""
    quote = lambda t: urllib.parse.quote(t, safe="")  # noqa: E731
    tasks = numbers.map(lambda s: ("GET", f"{TASKS_PATH}/{quote(s)}", {}, None))
    rids = st.sampled_from([driven["request_id"], driven_rid(1, "t0-e0"), "x"]) | st.text(
        max_size=40
    )
    query = st.fixed_dictionaries({}, optional={"wait_s": waits, "after": numbers})
    outcomes = st.builds(lambda r, q: ("GET", f"{OUTCOMES_PATH}/{quote(r)}", q, None), rids, query)
    records = _bodies(good, driven).map(lambda b: ("POST", RECORDS_PATH, {}, b))
    oversize = st.sampled_from(OVERSIZE).map(lambda k: ("POST", RECORDS_PATH, {}, k))
    others = st.builds(lambda m, p: (m, p, {}, b"{}"), st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
                       st.sampled_from([*OURS, "/", TASKS_PATH, "/nope"]))  # fmt: skip
    return st.one_of(records, tasks, outcomes, oversize, others)


# FastAPI's own answers when no route matches: the only 4xx without our `reason`
ROUTE_MISS = {(404, "Not Found"), (405, "Method Not Allowed")}


def test_every_route_answers_4xx_or_503_to_anything_and_the_intake_stays_up(intake):
    cfg, store, cap, thread = intake
    good_rec, _ = put_capture(store, cap, "req-fuzz")
    driven_rec, _ = put_capture(store, cap, driven_rid(2, "t1-e0"))  # task t1 is at seq 2
    good, driven = json.loads(good_rec.model_dump_json()), json.loads(driven_rec.model_dump_json())
    blob = b"{" + b" " * cap.max_record_bytes + b"}"
    valid = f"Bearer {TOKEN}"
    auths = st.sampled_from([valid] * 3 + ["Bearer nope", "", "Basic abc", "Bearer"])
    extras = st.dictionaries(st.sampled_from(["content-type", "x-request-id", "accept", "content-encoding"]),
                             header_values, max_size=2)  # fmt: skip
    seen: list[int] = []
    client = httpx.Client(base_url=thread.url, timeout=10.0)  # a hang fails too

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
    @given(req=_requests(good, driven), auth=auths, extra=extras)
    # what issue 33 found: a sequence the broker answers 408, digits int() cannot read; and a
    # key generation of more digits than int() converts
    @example(req=("GET", f"{TASKS_PATH}/0", {}, None), auth=valid, extra={})
    @example(req=("GET", f"{TASKS_PATH}/-1", {}, None), auth=valid, extra={})
    @example(req=("GET", f"{TASKS_PATH}/{2**64}", {}, None), auth=valid, extra={})
    @example(req=("GET", f"{OUTCOMES_PATH}/x", {"wait_s": "inf"}, None), auth=valid, extra={})
    @example(req=("POST", RECORDS_PATH, {}, driven_body(driven, "²")), auth=valid, extra={})
    @example(req=("POST", RECORDS_PATH, {}, driven_body(driven, "0")), auth=valid, extra={})
    @example(req=("POST", RECORDS_PATH, {}, driven_body(driven, str(2**64))), auth=valid, extra={})
    @example(req=("POST", RECORDS_PATH, {}, json.dumps(regen(good, "9" * 5000)).encode()),
             auth=valid, extra={})  # fmt: skip
    def hit(req, auth, extra):
        method, path, query, body = req
        if body == "plain":
            body = blob
        elif body == "chunked":  # no Content-Length: the intake counts while it reads
            body = iter([blob[i : i + 65536] for i in range(0, len(blob), 65536)])
        headers = {**extra, "authorization": auth} if auth else extra
        answer = client.request(method, path, params=query, content=body, headers=headers)
        code = answer.status_code
        assert code < 500 or code == 503, (code, method, path, query, answer.text[:300])
        if code >= 400:
            doc = answer.json()
            assert doc.get("reason") or (code, doc.get("detail")) in ROUTE_MISS, (path, doc)
        seen.append(code)

    try:
        hit()
    finally:
        client.close()
    assert len(seen) >= 300 and {200, 400, 401, 404, 413, 422} <= set(seen), sorted(set(seen))
    # the intake is up and serves valid requests of every kind afterwards
    with thread.client() as c:
        assert c.get("/healthz").status_code == 200
        assert c.get(f"{TASKS_PATH}/1").json()["sample_id"] == "t0-e0"
        posted = c.post(RECORDS_PATH, content=good_rec.model_dump_json())
        assert posted.status_code == 200 and posted.json()["status"] in ("accepted", "duplicate")
        metrics = c.get("/metrics").text
    assert 'code="500"' not in metrics


# ---------------------------------------------------------------- specbus serve
@pytest.fixture
def serving(chat_target):
    """`specbus serve`'s app on the tiny chat target (no capture: its routes are the subject),
    on uvicorn in a thread, on a loopback port; short answers (4 tokens) keep it fast."""
    import threading

    import uvicorn
    from specbus.core.config import TargetConfig
    from specbus.ops.live import bind
    from specbus.ops.services.common import free_port
    from specbus.producers.engines.hf import HFEngine
    from specbus.producers.live.generate import Generator
    from specbus.producers.live.serve import Server, build_app

    from tests.fixtures.live import wait_until

    engine = HFEngine(TargetConfig(model=str(chat_target), dtype="float32", device="cpu"))
    generator = Generator(engine, None, max_new_tokens=4, max_batch=2)
    port = free_port()
    config = uvicorn.Config(
        build_app(Server(generator, "tiny")), log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    sock = bind("127.0.0.1", port)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 30, "the server")
    yield url
    server.should_exit = True
    thread.join(10)
    generator.close()
    engine.close()
    sock.close()


def _serve_requests():
    """(method, path, body) for every route of `specbus serve`: completions and chats whose
    fields are each mostly valid (edges included: tiny floats, top_p 0, int64 seeds), else
    hostile, so that most reach generation; any JSON, any bytes."""
    hostile = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
               | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, 5e-324, -0.0]))  # fmt: skip

    def mostly(valid):  # 3 in 4 valid (one_of would flatten `hostile` into 6 branches of 7)
        return st.sampled_from([True, True, True, False]).flatmap(
            lambda ok: valid if ok else hostile
        )

    fields = {
        "max_tokens": mostly(st.integers(1, 8)),
        "temperature": mostly(st.floats(0, 2) | st.sampled_from([1e-300, 5e-324, 1e-45])),
        "top_p": mostly(st.floats(0, 1) | st.sampled_from([0.0, 1e-300])),
        "seed": mostly(st.integers(-(2**63), 2**63 - 1)),
        "n": mostly(st.just(1)),
        "stop": mostly(st.lists(st.text(max_size=3), max_size=5) | st.text(max_size=3)),
        "stream": mostly(st.booleans()),
        "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    }  # fmt: skip
    prompt = mostly(
        st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 127), min_size=1, max_size=8)
    )
    part = st.fixed_dictionaries({"type": st.just("text"), "text": mostly(st.text(max_size=20))})
    content = mostly(st.text(max_size=30) | st.lists(part, max_size=3))
    role = mostly(st.sampled_from(["user", "assistant", "system", "tool", "x"]))
    message = mostly(st.fixed_dictionaries({"role": role, "content": content}))
    messages = mostly(st.lists(message, min_size=1, max_size=4))
    completion = st.fixed_dictionaries({"prompt": prompt}, optional=fields)
    chat = st.fixed_dictionaries({"messages": messages}, optional=fields)
    dumped = lambda d: json.dumps(d).encode()  # noqa: E731 - json.dumps writes NaN/Infinity too
    posts = st.one_of(
        completion.map(lambda b: ("POST", "/v1/completions", dumped(b))),
        chat.map(lambda b: ("POST", "/v1/chat/completions", dumped(b))),
        st.builds(lambda p, b: ("POST", p, b),
                  st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/spec-capture/sink"]),
                  st.binary(max_size=100) | hostile.map(dumped)),
    )  # fmt: skip
    gets = st.sampled_from(["/v1/models", "/healthz", "/metrics", "/v1/spec-capture/sink"])
    kinds = st.sampled_from(["post"] * 4 + ["get"])
    return kinds.flatmap(lambda k: posts if k == "post" else gets.map(lambda p: ("GET", p, None)))


def test_every_serve_route_answers_400_or_503_to_anything_and_serves_on(serving):
    seen: list[int] = []
    client = httpx.Client(base_url=serving, timeout=30.0)

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
    @given(req=_serve_requests(), rid=st.none() | header_values)
    # what failed a whole generation wave before: a seed torch cannot take, a temperature
    # that is 0 in float32, top_p 0, content parts whose text is not text
    @example(
        req=(
            "POST",
            "/v1/completions",
            b'{"prompt": [5], "temperature": 0.5, "seed": 18446744073709551616}',
        ),
        rid=None,
    )
    @example(req=("POST", "/v1/completions", b'{"prompt": [5], "temperature": 1e-300}'), rid=None)
    @example(
        req=(
            "POST",
            "/v1/completions",
            b'{"prompt": [5], "temperature": 1, "top_p": 0, "stream": true}',
        ),
        rid=None,
    )
    @example(
        req=(
            "POST",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"text": 5}]}]}',
        ),
        rid=None,
    )
    def hit(req, rid):
        method, path, body = req
        headers = {"x-request-id": rid} if rid else {}
        answer = client.request(method, path, content=body, headers=headers)
        code = answer.status_code
        assert code < 500 or code == 503, (code, path, body, answer.text[:300])
        assert "server_error" not in answer.text or code == 503, (path, body, answer.text[:300])
        if code >= 400:
            assert answer.json()["error"]["message"], answer.text[:300]
        seen.append(code)

    try:
        hit()
    finally:
        client.close()
    assert len(seen) >= 200 and {200, 400} <= set(seen), sorted(set(seen))
    with httpx.Client(base_url=serving, timeout=30.0) as c:
        done = c.post(
            "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        )
        assert done.status_code == 200 and done.json()["usage"]["prompt_tokens"] == 3
